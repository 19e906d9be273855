"""The dynamic loss scale of fp16 training: a step whose gradients contain inf/NaN anywhere is
skipped for every block, head and tail, and the scale backs off, down to a floor
(``divergence.py`` says when the run stops).
"""

from __future__ import annotations

import torch

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """Loss scale for fp16: x ``backoff`` on overflow, x ``growth`` after ``interval`` clean steps,
    never below ``min_scale``.

    Defaults match ``torch.amp.GradScaler`` (2**16, 2.0, 0.5, 2000); the floor, 1, is DeepSpeed's
    and Megatron's: below it the scaled gradient is smaller than the true one, which only helps
    gradients that overflow fp16 unscaled. It also counts the backward passes that went through a
    scaled loss (``scale_loss``), so a plain ``loss.backward()`` is noticed (``take_scaled_backwards``).
    """

    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000, min_scale: float = 1.0) -> None:
        if not 0 < min_scale <= init_scale or growth <= 1 or not 0 < backoff < 1 or interval < 1:
            raise ValueError("DynamicLossScaler: need 0 < min_scale <= init_scale, growth > 1, 0 < backoff < 1, "
                             f"interval >= 1; got {min_scale}, {init_scale}, {growth}, {backoff}, {interval}")
        self.scale = float(init_scale)
        self.growth = growth
        self.backoff = backoff
        self.interval = interval
        self.min_scale = float(min_scale)
        self.clean_steps = 0
        self.overflows_in_a_row = 0
        """Consecutive steps that overflowed (skipped), up to the last one."""
        self.overflow_at_floor = False
        """Whether the last step overflowed with the scale already at ``min_scale`` (it cannot back off)."""
        self._scaled_backwards = 0

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (skipped) or did not overflow."""
        if found_inf:
            self.overflow_at_floor = self.scale <= self.min_scale
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.clean_steps = 0
            self.overflows_in_a_row += 1
        else:
            self.overflow_at_floor = False
            self.overflows_in_a_row = 0
            self.clean_steps += 1
            if self.clean_steps >= self.interval:  # >=: a state saved under a longer interval
                self.scale *= self.growth
                self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale; a backward pass from the result is counted."""
        scaled = loss * self.scale
        if scaled.requires_grad:
            scaled.register_hook(self._count_backward)
        return scaled

    def _count_backward(self, grad: torch.Tensor) -> None:
        self._scaled_backwards += 1

    def take_scaled_backwards(self) -> int:
        """Backward passes through ``scale_loss`` since the last call (the count starts again)."""
        count, self._scaled_backwards = self._scaled_backwards, 0
        return count

    def state_dict(self) -> dict:
        """``{"scale": current loss scale, "clean_steps": steps since the last change,
        "overflows_in_a_row": skipped steps since the last clean one}``."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows_in_a_row": self.overflows_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s scale, clean-step and overflow counts (states saved
        before the overflow count existed start it at 0)."""
        if not isinstance(state, dict) or not {"scale", "clean_steps"} <= state.keys():
            raise ValueError(f"loss scale state: expected a dict with 'scale' and 'clean_steps', got {state!r}")
        scale, clean = float(state["scale"]), int(state["clean_steps"])
        in_a_row = int(state.get("overflows_in_a_row", 0))
        if not (scale > 0 and clean >= 0 and in_a_row >= 0):
            raise ValueError(f"loss scale state: need scale > 0 and clean_steps, overflows_in_a_row >= 0, "
                             f"got {scale}, {clean} and {in_a_row}")
        self.scale, self.clean_steps, self.overflows_in_a_row = scale, clean, in_a_row
