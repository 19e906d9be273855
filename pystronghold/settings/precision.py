"""Compute precision (fp32, bf16, fp16): the one table of names to dtypes for every command and
the runtime.

In bf16/fp16 every parameter the model computes with is in that dtype (blocks' slots, head, tail);
the optimizer keeps fp32 masters (the host store for blocks, device copies for head and tail) and
writes the compute-precision copy after each update. Gradients leave the device in compute
precision; fp16 also scales the loss (``runtime/optimizer/loss_scale.py``).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "compute_dtype"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype of ``precision`` ("fp32", "bf16" or "fp16")."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}") from None
