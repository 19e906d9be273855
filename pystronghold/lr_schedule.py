"""Learning-rate schedule: linear warm-up, then cosine decay to a floor.

For step k, W = ``warmup_steps``, D = ``decay_steps``, f = ``min_ratio``, peak = the optimizer's
``lr``: ``peak * (k + 1) / W`` for k < W, cosine from peak to ``peak * f`` for W <= k < D, then
``peak * f``. A ``torch.optim.lr_scheduler.LambdaLR`` over a picklable callable, so its
``state_dict()`` round-trips and any optimizer (``engine.optimizer`` included) works.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["WarmupCosine", "warmup_cosine"]


# NOTE: no slots: LambdaLR.state_dict() saves a callable object's __dict__ (so the schedule's
# settings travel with the scheduler's state), and a slots class has none.
@dataclass(kw_only=True)
class WarmupCosine:
    """The schedule as a multiplier of the peak learning rate (a ``LambdaLR`` lambda)."""

    warmup_steps: int = 0
    """Steps of linear warm-up from peak / warmup_steps up to the peak (0: start at the peak)."""
    decay_steps: int
    """Step at which the cosine reaches the floor (counted from 0, warm-up included); >= warmup_steps."""
    min_ratio: float = 0.1
    """Floor as a fraction of the peak learning rate, in [0, 1]."""

    def __post_init__(self) -> None:
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"WarmupCosine.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.decay_steps, int) or self.decay_steps < max(1, self.warmup_steps):
            raise ValueError(f"WarmupCosine.decay_steps must be an int >= max(1, warmup_steps="
                             f"{self.warmup_steps}), got {self.decay_steps!r}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine.min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def __call__(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step >= self.decay_steps:
            return self.min_ratio
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup_steps: int, decay_steps: int,
                  min_ratio: float = 0.1, last_epoch: int = -1) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``WarmupCosine`` from each param group's current ``lr`` (the peak).

    Call ``scheduler.step()`` after each ``optimizer.step()``.
    """
    schedule = WarmupCosine(warmup_steps=warmup_steps, decay_steps=decay_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule, last_epoch=last_epoch)
