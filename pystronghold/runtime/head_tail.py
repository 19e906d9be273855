"""Head and tail trained from host memory (``RuntimeConfig.head_tail_on_host``).

The parameters outside the block stack (embedding, final norm, LM head: 1.05B with a 128K
vocabulary) keep on the device only what the model computes with, their values and gradients in
the compute dtype. ``HostHeadTail`` holds their fp32 masters and AdamW moments in one host arena
(pinned on CUDA), beside a host copy of each gradient and, in bf16/fp16, the compute-dtype shadow
the update writes: the blocks' five states (``layout.stored_states``). At ``step()`` the gradients
are copied out, the blocks' fused CPU Adam (``adam_step_multi_``) updates the masters, and the new
values are copied back before the next forward.

It has ``DeviceAdamW``'s interface (``params``, ``masters``, ``grad_norms``, ``step``,
``zero_grad``, ``state_of``, ``load_state``), so the step, state dicts and checkpoints read and
write the masters wherever they live. ``head_tail_on_host`` is the rule "auto" follows, for the
runtime and the planner alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from pystronghold.optim.functional import adam_step_multi_, grad_sq_norm, param_grad_norms
from pystronghold.optim.hyper import AdamWHyper
from pystronghold.runtime.memory import layout
from pystronghold.runtime.optimizer.divergence import DivergenceError

__all__ = ["HostHeadTail", "head_tail_on_host", "host_head_tail_bytes", "HEAD_TAIL_AUTO_FRACTION"]

HEAD_TAIL_AUTO_FRACTION = 1 / 8
"""``head_tail_on_host="auto"`` puts head and tail on the host when, trained on the device (values,
gradients, moments, masters), they would take more than this fraction of the device's memory."""


def head_tail_on_host(setting: bool | str, trainable_numel: int, frozen_numel: int, dtype: torch.dtype,
                      device_total_bytes: int | None) -> bool:
    """Whether head and tail train from host memory: ``setting`` when it is a bool; for "auto", True
    when on the device they would take more than ``HEAD_TAIL_AUTO_FRACTION`` of
    ``device_total_bytes`` (a CUDA device's memory; None, the CPU backend: False, its "device" is
    host memory anyway). ``trainable_numel``/``frozen_numel``: elements of the head and tail."""
    if setting != "auto":
        return bool(setting)
    if device_total_bytes is None:
        return False
    on_device = trainable_numel * layout.device_bytes_per_param(dtype) + frozen_numel * dtype.itemsize
    return on_device > HEAD_TAIL_AUTO_FRACTION * device_total_bytes


def host_head_tail_bytes(numels: list[int], dtype: torch.dtype) -> int:
    """Host bytes of ``HostHeadTail`` for trainable parameters of ``numels`` elements: per parameter
    one ``ARENA_ALIGN``-rounded buffer of each stored state (fp32 master and moments, the gradient
    and in bf16/fp16 the shadow in ``dtype``: 16 bytes per element), in one arena."""
    return layout.arena_bytes(sum(layout.buffer_bytes(n, state, dtype)
                                  for n in numels for state in layout.stored_states(dtype)))


class HostHeadTail:
    """AdamW of head and tail over fp32 masters in host memory (the engine's ``device_optimizer``
    when ``head_tail_on_host``); the device keeps the parameters in the compute dtype."""

    def __init__(self, params: list[torch.nn.Parameter], masters: list[torch.Tensor], groups: list[int] | None,
                 *, backend, dtype: torch.dtype, bitwise_torch: bool = False, tracer=None) -> None:
        """``params``: the trainable head/tail parameters (on the device, in ``dtype``);
        ``masters``: their fp32 values from before the cast (any device); ``groups``: the engine's
        param group of each (default all 0); ``backend``: makes the host arena and the copies;
        ``bitwise_torch``: the blocks' setting (``AdamW.bitwise_torch``)."""
        if any(p.dtype != dtype for p in params):
            raise ValueError(f"HostHeadTail: the parameters must be in the compute dtype {dtype}, got "
                             f"{sorted({str(p.dtype) for p in params})}")
        self.params = params
        self._groups = list(groups) if groups is not None else [0] * len(params)
        self._backend, self._tracer, self.bitwise_torch = backend, tracer, bool(bitwise_torch)
        self._states = layout.stored_states(dtype)
        self.host_bytes = host_head_tail_bytes([p.numel() for p in params], dtype)
        """Bytes of the host arena holding every state."""
        self._arena = backend.host_arena(max(self.host_bytes, layout.ARENA_ALIGN))
        self._host = [{state: self._arena.allocate(f"head_tail.{i}.{state}", p.shape, layout.state_dtype(state, dtype))
                       for state in self._states} for i, p in enumerate(params)]
        for host, m in zip(self._host, masters):
            host["master"].copy_(m.detach())
        self.masters = [host["master"] for host in self._host]
        """fp32 masters in host memory, one per parameter (what state dicts and checkpoints read)."""
        self._steps = [0] * len(params)  # AdamW steps each parameter has taken (torch counts per parameter)
        self._uploads: list = []  # copies of new values to the device still in flight

    @property
    def pinned(self) -> bool:
        """Whether the host arena is pinned (registered with CUDA)."""
        return self._arena.pinned

    def arena_range(self) -> tuple[int, int]:
        """``(first, end)`` host addresses of the arena: every state of head and tail lies inside."""
        return self._arena.base_address, self._arena.base_address + self._arena.capacity_bytes

    def state_of(self, index: int) -> dict:
        """torch AdamW's state of parameter ``index`` (``step``, ``exp_avg``, ``exp_avg_sq``; {}
        before its first update). The moments are the live host tensors: copy them to keep them."""
        if not self._steps[index]:
            return {}
        host = self._host[index]
        return {"step": torch.tensor(float(self._steps[index])), "exp_avg": host["exp_avg"],
                "exp_avg_sq": host["exp_avg_sq"]}

    @torch.no_grad()
    def load_state(self, index: int, state: dict) -> None:
        """Replace parameter ``index``'s AdamW state (``{}``: none, as before the first update)."""
        self._wait_uploads()
        host = self._host[index]
        for key in ("exp_avg", "exp_avg_sq"):
            if state:
                host[key].copy_(state[key].detach())
            else:
                host[key].zero_()
        self._steps[index] = int(float(state["step"])) if state else 0

    def grad_norms(self, grad_scale: float) -> dict[int, torch.Tensor]:
        """fp32 L2 norm of each parameter's gradient x ``grad_scale``, keyed by id(parameter), taken
        on the device as ``DeviceAdamW`` takes them."""
        with_grad = [p for p in self.params if p.grad is not None]
        norms = param_grad_norms([p.grad for p in with_grad], grad_scale).cpu()
        return {id(p): n for p, n in zip(with_grad, norms)}

    @torch.no_grad()
    def step(self, hyper: list[AdamWHyper]) -> None:
        """One AdamW step: gradients to the host, the fused Adam over each param group (per
        parameter step counts, as torch keeps them; a parameter without gradient is not updated),
        the new values back to the device, ordered before the next forward. DivergenceError, with
        nothing written, when a gradient has inf/NaN values."""
        self._wait_uploads()
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not with_grad:
            return
        backend = self._backend
        grads = [_contiguous(self.params[i].grad) for i in with_grad]
        after = [backend.compute_marker()]  # the backward that made the gradients (and any copy above)
        copies = [backend.d2h(self._host[i]["grad"], g, after) for i, g in zip(with_grad, grads)]
        for handle in copies:
            handle.wait()
        calls: dict[tuple[int, int], list[int]] = {}  # (param group, AdamW step) -> parameters
        for i in with_grad:
            calls.setdefault((self._groups[i], self._steps[i] + 1), []).append(i)
        nbytes = sum(self._host[i]["master"].nbytes for i in with_grad)
        with (self._tracer.span("optimizer", None, nbytes=nbytes) if self._tracer is not None
              else contextlib.nullcontext()):
            # NOTE: every gradient checked before any write, so an inf/NaN leaves all of them as they were
            if len(calls) > 1 and not all(math.isfinite(grad_sq_norm(self._host[i]["grad"], hyper[0].grad_scale))
                                          for i in with_grad):
                raise DivergenceError(hyper[0].step, "a head/tail gradient has inf/NaN values; nothing was updated")
            for (group, step), indices in calls.items():

                def flat(state: str) -> list[torch.Tensor]:
                    return [self._host[i][state].view(-1) for i in indices]

                h = dataclasses.replace(hyper[group], step=step)
                if not adam_step_multi_(flat("master"), flat("grad"), flat("exp_avg"), flat("exp_avg_sq"), h,
                                        shadows=flat("shadow") if "shadow" in self._states else None,
                                        check_finite=len(calls) == 1, bitwise_torch=self.bitwise_torch):
                    raise DivergenceError(hyper[0].step, "a head/tail gradient has inf/NaN values; nothing "
                                          "was updated")
        for i in with_grad:
            self._steps[i] += 1
        upload = "shadow" if "shadow" in self._states else "master"
        for i in with_grad:
            p, new = self.params[i], self._host[i][upload]
            if not p.is_contiguous():  # the copy engine moves whole contiguous buffers
                p.copy_(new)
                continue
            self._uploads.append(backend.h2d(p.data, new))
            backend.compute_wait(self._uploads[-1])  # the next forward reads the new values

    def _wait_uploads(self) -> None:
        """The last step's copies to the device are done (their host sources may be written again)."""
        for handle in self._uploads:
            handle.wait()
        self._uploads = []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()

