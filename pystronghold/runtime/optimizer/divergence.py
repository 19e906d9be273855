"""What stops a training run whose numbers diverged, and the one line it stops with.

fp16: a step with inf/NaN gradients is skipped; the run stops on overflow at the loss scale's
floor or after ``max_skipped_steps`` skips in a row. bf16/fp32: the first inf/NaN gradient of a
streamed block (or the clipping norm) stops the run. ``check_finite_state`` keeps non-finite state
out of checkpoints. Each raises ``DivergenceError`` naming the step and the quantity.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DivergenceError", "ADVICE", "check_finite_state", "nonfinite_entry", "describe_nonfinite"]

ADVICE = "training diverged: lower the learning rate (or warm it up longer) and restart, or resume from an " \
         "earlier checkpoint"
"""What to do about it (true whatever the precision and clipping)."""


class DivergenceError(FloatingPointError):
    """Training produced inf/NaN values and cannot go on; ``str()`` is one line naming the step.

    ``step``: the optimizer step (1-based, skipped fp16 steps counted) that found them;
    ``skipped_steps``: fp16 steps skipped for an overflow so far (0 in bf16/fp32)."""

    def __init__(self, step: int, what: str, *, skipped_steps: int = 0) -> None:
        self.step, self.skipped_steps = step, skipped_steps
        super().__init__(f"step {step}: {what}; {ADVICE}")


def _kind(t: torch.Tensor) -> str:
    return "NaN" if bool(torch.isnan(t).any()) else "inf"


def check_finite_state(tensors: dict[str, torch.Tensor], *, step: int, where: str) -> None:
    """DivergenceError naming the first tensor of ``tensors`` (by name) that holds inf or NaN.

    ``where``: what would have held them (e.g. the checkpoint file), for the message."""
    bad = nonfinite_entry(tensors)
    if bad is not None:
        raise DivergenceError(step, f"not writing {where}: {bad}")


def nonfinite_entry(tensors: dict[str, torch.Tensor]) -> str | None:
    """``"NAME holds NaN values"`` (or inf) for the first tensor of ``tensors`` that holds inf or
    NaN, else None. One pass per tensor, ``torch.aminmax`` (about 6 GB/s on 2 cores, several times
    faster than serialising and hashing it): a NaN makes both results NaN, an inf one of them inf,
    and finite values cannot overflow (a sum could)."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not all(math.isfinite(v) for v in torch.aminmax(t)):
            return f"{name} holds {_kind(t)} values"
    return None


def describe_nonfinite(names: list[str], norms: list[torch.Tensor]) -> str:
    """Which per-parameter gradient norms are inf/NaN: "... in N of M parameters, the first NAME"
    (model order), or that none here is (the non-finite ones are on another rank)."""
    bad = [n for n, v in zip(names, norms) if not math.isfinite(float(v))]
    if not bad:
        return "the inf/NaN gradients are on another rank"
    return f"inf/NaN gradients in {len(bad)} of {len(names)} parameters, the first {bad[0]}"
