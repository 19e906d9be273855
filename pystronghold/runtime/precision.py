"""Compute precision (fp32, bf16, fp16) and the dynamic loss scaler used with fp16.

In bf16/fp16 every parameter the model computes with is in that dtype (blocks' slots, head, tail);
the optimizer keeps fp32 masters (the host store for blocks, device copies for head and tail) and
writes the compute-precision copy after each update. Gradients leave the device in compute
precision. fp16 scales the loss; a step whose gradients contain inf/NaN anywhere is skipped for
every block, head and tail, and the scale backs off.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "compute_dtype", "DynamicLossScaler"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype of ``precision`` ("fp32", "bf16" or "fp16")."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}") from None


class DynamicLossScaler:
    """Loss scale for fp16: x ``backoff`` on overflow, x ``growth`` after ``interval`` clean steps.

    Defaults match ``torch.amp.GradScaler`` (2**16, 2.0, 0.5, 2000).
    """

    def __init__(self, init_scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        if init_scale <= 0 or growth <= 1 or not 0 < backoff < 1 or interval < 1:
            raise ValueError("DynamicLossScaler: need init_scale > 0, growth > 1, 0 < backoff < 1, "
                             f"interval >= 1; got {init_scale}, {growth}, {backoff}, {interval}")
        self.scale = float(init_scale)
        self.growth = growth
        self.backoff = backoff
        self.interval = interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (skipped) or did not overflow."""
        if found_inf:
            self.scale *= self.backoff
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.interval:  # >=: a state saved under a longer interval
                self.scale *= self.growth
                self.clean_steps = 0

    def state_dict(self) -> dict:
        """``{"scale": current loss scale, "clean_steps": steps since the last change}``."""
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s scale and clean-step count."""
        if not isinstance(state, dict) or not {"scale", "clean_steps"} <= state.keys():
            raise ValueError(f"loss scale state: expected a dict with 'scale' and 'clean_steps', got {state!r}")
        scale, clean = float(state["scale"]), int(state["clean_steps"])
        if not (scale > 0 and clean >= 0):
            raise ValueError(f"loss scale state: need scale > 0 and clean_steps >= 0, got {scale} and {clean}")
        self.scale, self.clean_steps = scale, clean
