"""Functional fused CPU Adam/AdamW over flat buffers (the runtime's entry point).

Typed wrappers over the C++ operators ``torch.ops.pystronghold.adam_step``, ``adam_step_multi``,
``grad_sq_norm`` and ``param_grad_norms`` (``pystronghold.ops``): one SIMD pass, OpenMP threads,
the GIL released; hyper-parameters travel as one frozen ``AdamWHyper``. The arithmetic follows
``torch.optim.AdamW``/``Adam`` (single-tensor CPU path) with the same roundings, except the sqrt:
by default the IEEE SIMD sqrt, so ``param`` may differ from torch by ~1 ulp of each step's update;
``bitwise_torch=True`` uses MKL's ``vmsSqrt`` as torch does, bit-identical and slower.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops import native_ops
from .hyper import AdamWHyper

__all__ = ["adam_step_", "adam_step_multi_", "grad_sq_norm", "param_grad_norms", "device_param_grad_norms"]


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: AdamWHyper,
    *,
    shadow: torch.Tensor | None = None,
    check_finite: bool = True,
    bitwise_torch: bool = False,
) -> bool:
    """One Adam/AdamW step over flat CPU buffers, in place; returns whether it was applied.

    ``param``, ``exp_avg``, ``exp_avg_sq``: fp32, contiguous, on the CPU, updated in place; ``grad``
    (fp32/bf16/fp16, same size) is multiplied by ``hyper.grad_scale`` (an ``AdamWHyper``). ``shadow``
    (optional bf16/fp16) receives the rounded new param. ``check_finite=False`` skips the inf/NaN scan
    when the caller knows the grad is finite; ``bitwise_torch=True`` matches
    ``torch.optim.AdamW(foreach=False)`` bit for bit, slower. Returns False, touching nothing, when the
    scaled grad is not finite. Raises TypeError for a wrong ``hyper`` and ValueError for a wrong dtype,
    device, layout or size, or overlapping buffers.
    """
    h = _checked("adam_step_", hyper)
    return bool(native_ops().adam_step(
        param, grad, exp_avg, exp_avg_sq, shadow, h.step, h.lr, h.betas[0], h.betas[1], h.eps, h.weight_decay,
        h.adamw, h.grad_scale, bool(check_finite), bool(bitwise_torch)))


def adam_step_multi_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hyper: AdamWHyper,
    *,
    shadows: Sequence[torch.Tensor] | None = None,
    check_finite: bool = True,
    bitwise_torch: bool = False,
) -> bool:
    """``adam_step_`` over lists of flat buffers (one param group), in one parallel region.

    Results equal one ``adam_step_`` per tensor, element for element. All grads share one dtype, as
    do all shadows; no two buffers may overlap. Returns True when applied to every tensor (also for
    empty lists); False, with nothing written, when any scaled grad is not finite (``check_finite``).
    """
    h = _checked("adam_step_multi_", hyper)
    lists = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)]
    shadows = None if shadows is None else list(shadows)
    if not any(lists) and not shadows:
        return True  # NOTE: the dispatcher needs a tensor to choose a kernel; nothing to update
    return bool(native_ops().adam_step_multi(
        *lists, shadows, h.step, h.lr, h.betas[0], h.betas[1], h.eps, h.weight_decay, h.adamw, h.grad_scale,
        bool(check_finite), bool(bitwise_torch)))


def _checked(fn: str, hyper) -> AdamWHyper:
    if not isinstance(hyper, AdamWHyper):
        raise TypeError(f"{fn}: hyper must be a pystronghold.optim.AdamWHyper, got {type(hyper).__name__}")
    return hyper


def grad_sq_norm(grad: torch.Tensor, grad_scale: float = 1.0) -> float:
    """Sum of squares of ``grad * grad_scale`` (no square root), accumulated in float64.

    The product is rounded to fp32 first (the value Adam consumes). Returns inf or NaN when any
    value is not finite, so one call serves both global-norm clipping and the overflow check.

    Raises:
        ValueError: ``grad`` is not a contiguous CPU fp32/bf16/fp16 tensor, or ``grad_scale`` is not finite.
    """
    return native_ops().grad_sq_norm(grad, float(grad_scale)).item()


# ---- per-parameter gradient norms, as torch.nn.utils.clip_grad_norm_ takes them

def param_grad_norms(grads: Sequence[torch.Tensor], grad_scale: float = 1.0) -> torch.Tensor:
    """fp32 L2 norm of each gradient x ``grad_scale``, shape (len(grads),), on the gradients' device.

    On the CPU bit for bit ``torch.linalg.vector_norm(g.float() * grad_scale)`` whatever the thread
    count; other devices: ``device_param_grad_norms``. Raises ValueError when the gradients are on
    several devices, a dtype is not float32/bfloat16/float16, or ``grad_scale`` is not finite.
    """
    if not grads:
        return torch.zeros(0)
    device = grads[0].device
    if any(g.device != device for g in grads):
        raise ValueError(f"param_grad_norms: grads must be on one device, got {sorted({str(g.device) for g in grads})}")
    if device.type == "cpu":
        return native_ops().param_grad_norms(list(grads), float(grad_scale))
    return device_param_grad_norms(grads, grad_scale)


def device_param_grad_norms(grads: Sequence[torch.Tensor], grad_scale: float = 1.0) -> torch.Tensor:
    """fp32 L2 norm of each gradient x ``grad_scale`` with ``torch._foreach_norm`` (the kernel of
    ``clip_grad_norm_`` on CUDA), stacked on the gradients' device without a host sync.

    fp32 gradients at scale 1 go to one ``_foreach_norm`` call; others are scaled in fp32 one
    parameter at a time (at most one parameter's fp32 copy alive), as the host path does."""
    if not grads:
        return torch.zeros(0)
    if grad_scale == 1.0 and all(g.dtype == torch.float32 for g in grads):
        return torch.stack(torch._foreach_norm(list(grads)))
    return torch.stack([torch._foreach_norm([g.float() * grad_scale if grad_scale != 1.0 else g.float()])[0]
                        for g in grads])
