"""``DeviceAdamW``: the AdamW of parameters that live on the device (head, tail, resident blocks).

``torch.optim.AdamW`` over fp32 masters (fused on CUDA, torch's single-tensor loop elsewhere: the
kernel plain PyTorch runs there), with the engine's param groups and, at each step, their values
from the engine's ``AdamWHyper`` list. torch keeps its own step count per parameter (``set_steps``
aligns it after a state load); the hyper's ``grad_scale`` multiplies the gradients first.

A step runs one block at a time (one torch optimizer per block): a block's fp32 gradients (the
compute-precision ones cast and scaled) exist only during its own update, so they never take the
device memory of every resident block at once. AdamW is elementwise, so the result is the same
bit for bit as one update over every parameter.
"""

from __future__ import annotations

import torch

from .functional import param_grad_norms
from .hyper import AdamW, AdamWHyper

__all__ = ["DeviceAdamW", "fused_adamw_for"]


def fused_adamw_for(device: torch.device | str) -> bool:
    """Whether ``DeviceAdamW`` of masters on ``device`` runs torch's fused AdamW kernel: on CUDA,
    when this torch has it (``torch._fused_adamw_``); elsewhere torch's single-tensor loop, the
    kernel plain PyTorch runs on the CPU (whose results the CPU tests compare against)."""
    return torch.device(device).type == "cuda" and hasattr(torch, "_fused_adamw_")


class DeviceAdamW:
    """AdamW of head and tail, on the device, over fp32 masters.

    In fp32 the masters are the parameters themselves; in bf16/fp16 they are fp32 copies and the
    parameters are rewritten in compute precision after each update.
    """

    def __init__(self, params: list[torch.nn.Parameter], spec: AdamW, masters: list[torch.Tensor],
                 groups: list[int] | None = None, fused: bool = False, blocks: list[int] | None = None) -> None:
        """``masters``: fp32 values of ``params`` taken before they were cast to compute precision;
        ``groups``: the engine's param group of each parameter (default all in group 0); ``fused``:
        torch's fused AdamW kernel (``fused_adamw_for`` the device); otherwise its single-tensor loop;
        ``blocks``: how many of ``params``, in order, each block updated on its own has (default:
        one block of all)."""
        self.params = params
        self.fused = fused
        half = any(p.dtype != torch.float32 for p in params)
        self.masters = [m.detach().clone().requires_grad_(True) for m in masters] if half else params
        groups = groups if groups is not None else [0] * len(params)
        blocks = [len(params)] if blocks is None else blocks
        if sum(blocks) != len(params) or any(n < 0 for n in blocks):
            raise ValueError(f"DeviceAdamW: blocks={blocks} must be counts >= 0 summing to the "
                             f"{len(params)} parameters")
        self.blocks = [range(start, start + n) for start, n in
                       zip([sum(blocks[:i]) for i in range(len(blocks))], blocks) if n]
        """Parameter indices of each block, updated one block after the other."""
        self._opts, self._group_ids, self._opt_of = [], [], {}
        for block in self.blocks:
            ids = sorted({groups[i] for i in block})  # engine group of each torch group
            torch_groups = [{"params": [self.masters[i] for i in block if groups[i] == gid]} for gid in ids]
            self._opts.append(torch.optim.AdamW(torch_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                                weight_decay=spec.weight_decay, foreach=False,
                                                fused=True if fused else None))
            self._group_ids.append(ids)
            self._opt_of.update({i: self._opts[-1] for i in block})

    def _step_tensor(self, index: int, value: float) -> torch.Tensor:
        # NOTE: where torch keeps it: on the parameter's device for the fused kernel, else on the CPU
        device = self.masters[index].device if self.fused else "cpu"
        return torch.tensor(float(value), dtype=torch.float32, device=device)

    @torch.no_grad()
    def write_moment(self, index: int, key: str, value: torch.Tensor) -> None:
        """Overwrite moment ``key`` ("exp_avg"/"exp_avg_sq") of parameter ``index``; a parameter
        without state gets zero moments and step 0 first (AdamW's state before its first update)."""
        m, opt = self.masters[index], self._opt_of[index]
        st = opt.state.get(m)
        if not st:
            st = opt.state[m] = {"step": self._step_tensor(index, 0.0), "exp_avg": torch.zeros_like(m),
                                       "exp_avg_sq": torch.zeros_like(m)}
        st[key].copy_(value)

    @torch.no_grad()
    def set_steps(self, steps: int) -> None:
        """Set the step count of every parameter that has AdamW state to ``steps``."""
        for i, m in enumerate(self.masters):
            st = self._opt_of[i].state.get(m)
            if st:
                st["step"] = self._step_tensor(i, steps)

    def state_of(self, index: int) -> dict:
        """torch AdamW state of parameter ``index`` (``step``, ``exp_avg``, ``exp_avg_sq``; {} before
        its first update). The live tensors: copy them to keep them."""
        return dict(self._opt_of[index].state.get(self.masters[index], {}))

    @torch.no_grad()
    def load_state(self, index: int, state: dict) -> None:
        """Replace parameter ``index``'s AdamW state (``{}``: none, as before the first update)."""
        m, opt = self.masters[index], self._opt_of[index]
        if not state:
            opt.state.pop(m, None)
            return
        opt.state[m] = {"step": self._step_tensor(index, float(state["step"])),
                              **{k: state[k].detach().to(device=m.device, dtype=torch.float32, copy=True)
                                 for k in ("exp_avg", "exp_avg_sq")}}

    def grad_norms(self, grad_scale: float) -> dict[int, torch.Tensor]:
        """fp32 L2 norm of each parameter's gradient x ``grad_scale``, keyed by id(parameter)."""
        with_grad = [p for p in self.params if p.grad is not None]
        # taken where the gradients are; one copy to the host, where global_grad_norm combines them
        norms = param_grad_norms([p.grad for p in with_grad], grad_scale).cpu()
        return {id(p): n for p, n in zip(with_grad, norms)}

    @torch.no_grad()
    def step(self, hyper: list[AdamWHyper]) -> None:
        """One AdamW step, block after block; ``hyper``: the engine's param groups at this step
        (``WindowOptimizer.hyper``), whose ``grad_scale`` (clip coefficient / loss scale, one for all
        groups) multiplies the gradients. A block's fp32 gradients are made (cast and scaled) just
        before its update and dropped after it (in fp32 the gradients themselves are scaled)."""
        grad_scale = hyper[0].grad_scale
        for block, opt, ids in zip(self.blocks, self._opts, self._group_ids):
            for group, gid in zip(opt.param_groups, ids):
                h = hyper[gid]
                group.update(lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)
            for i in block:
                p, m = self.params[i], self.masters[i]
                if p.grad is None:
                    m.grad = None
                elif m is not p:
                    # NOTE: the scale folded into the fp32 copy (one tensor, multiplied in place)
                    m.grad = p.grad.float().mul_(grad_scale) if grad_scale != 1.0 else p.grad.float()
                elif grad_scale != 1.0:
                    p.grad.mul_(grad_scale)
            opt.step()
            for i in block:
                p, m = self.params[i], self.masters[i]
                if m is not p:
                    p.copy_(m)
                    m.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None
