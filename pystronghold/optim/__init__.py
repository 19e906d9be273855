"""Optimizers of pystronghold: the fused CPU Adam/AdamW (`CPUAdam`) and its functional form."""

from .cpu_adam import CPUAdam
from .functional import adam_step_, adam_step_multi_, grad_sq_norm

__all__ = ["CPUAdam", "adam_step_", "adam_step_multi_", "grad_sq_norm"]
