"""Layers and fused functions of the GPT blocks: Triton on CUDA tensors, plain torch on CPU tensors.

`pystronghold.nn.functional` (imported as PF) holds attention, layer_norm, rms_norm, bias_gelu,
bias_dropout_add and vocab_parallel_cross_entropy; `LayerNorm` and `RMSNorm` are drop-in modules.
"""

from . import functional
from .modules import LayerNorm, RMSNorm

__all__ = ["functional", "LayerNorm", "RMSNorm"]
