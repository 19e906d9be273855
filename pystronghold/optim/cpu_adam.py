"""`CPUAdam`: the fused CPU Adam/AdamW as a `torch.optim.Optimizer`.

Param groups, `add_param_group`, `lr` edits, LR schedulers and `zero_grad` behave as in torch.
`state_dict()` has the keys and layout of `torch.optim.AdamW` (or `torch.optim.Adam` with
``adamw=False``): per parameter ``step`` (0-dim fp32 tensor), ``exp_avg`` and ``exp_avg_sq``; per
group ``lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, differentiable, fused,
decoupled_weight_decay``. A state dict saved by either optimizer loads into the other.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from .functional import adam_step_multi_
from .hyper import AdamWHyper

__all__ = ["CPUAdam"]

log = logging.getLogger(__name__)

# Options of torch.optim.AdamW that this optimizer does not implement, with their only allowed values.
_UNSUPPORTED = {"amsgrad": (False,), "maximize": (False,), "capturable": (False,),
                "differentiable": (False,), "foreach": (None, False), "fused": (None, False)}


def _check_group(group: dict) -> None:
    """Options torch has and this optimizer does not; the values themselves: ``AdamWHyper``."""
    for key, allowed in _UNSUPPORTED.items():
        if group.get(key, allowed[0]) not in allowed:
            raise ValueError(f"CPUAdam does not support {key}={group[key]!r} (allowed: "
                             f"{' or '.join(map(repr, allowed))}); use torch.optim.AdamW for that")


def _hyper(group: dict, step: int) -> AdamWHyper:
    """The group's values at ``step``, validated (``CPUAdam: ...`` naming the field)."""
    try:
        return AdamWHyper.from_group(group, step=step, adamw=group["decoupled_weight_decay"])
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"CPUAdam: {exc}") from None


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 parameters in host memory, one fused C++ pass per param group.

    ``lr``, ``betas``, ``eps`` as in torch; ``weight_decay`` defaults to 1e-2 for AdamW, 0 for Adam
    (``adamw=False``: ``torch.optim.Adam`` semantics, L2 decay). ``amsgrad``, ``maximize``,
    ``foreach``, ``capturable``, ``differentiable``, ``fused`` are accepted only at their defaults
    (ValueError otherwise). ``bitwise_torch=True``: bit-identical to ``torch.optim.AdamW(foreach=False)``,
    slower; default: within a few ulp of torch. ``step()`` returns the closure's loss; as in torch a
    non-finite gradient is not skipped (use ``pystronghold.optim.adam_step_`` for loss-scaling skips).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float | None = None, amsgrad: bool = False, *,
                 adamw: bool = True, maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False, fused: bool | None = None,
                 bitwise_torch: bool = False) -> None:
        if weight_decay is None:
            weight_decay = 1e-2 if adamw else 0.0
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=bool(adamw))
        _check_group(defaults)
        _hyper(defaults, step=1)
        self.bitwise_torch = bool(bitwise_torch)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_group(group)
        _hyper(group, step=1)
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"CPUAdam: parameters must be fp32 CPU tensors, got {p.dtype} on {p.device}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """One optimizer step over every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            by_step: dict[int, list[torch.Tensor]] = {}  # one fused call per distinct step count
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("CPUAdam does not support sparse gradients")
                if not p.is_contiguous():
                    raise ValueError(f"CPUAdam: parameters must be contiguous, got strides {p.stride()}")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                by_step.setdefault(int(state["step"].item()) + 1, []).append(p)
            for step, params in by_step.items():
                states = [self.state[p] for p in params]
                # NOTE: check_finite=False keeps torch's semantics (NaN/inf propagate) and saves a read.
                adam_step_multi_(
                    [p.view(-1) for p in params], [p.grad.reshape(-1) for p in params],
                    [s["exp_avg"].view(-1) for s in states], [s["exp_avg_sq"].view(-1) for s in states],
                    _hyper(group, step), check_finite=False, bitwise_torch=self.bitwise_torch)
                for s in states:
                    s["step"].fill_(float(step))
        return loss
