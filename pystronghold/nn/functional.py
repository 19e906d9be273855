"""Fused ops of the GPT blocks, dispatched to Triton on CUDA tensors and to plain torch elsewhere.

Every function takes the same arguments on both paths and is differentiable on both:
- CUDA tensors: the Triton kernels of `pystronghold.kernels` (imported on first use).
- CPU tensors: the pure-torch references of `pystronghold.kernels.reference` (no triton import),
  unless `PYSTRONGHOLD_TRITON_ON_CPU=1` (read at every call), which runs the Triton kernels on CPU
  through the Triton interpreter; `TRITON_INTERPRET=1` must then be set before the kernel modules are
  first imported (`pystronghold.kernels._config` sets it if PYSTRONGHOLD_TRITON_ON_CPU is already set).
Inputs the Triton path cannot take (dtype other than fp32/fp16/bf16, head dim outside 16..128, norm
width over 16384, mismatched shapes) raise ValueError there; non-contiguous inputs are copied to
contiguous ones (never modified). When triton is not installed, CUDA tensors fall back to the
reference with a one-time warning. The two dropout paths draw different masks for the same seed
(Philox on Triton, torch's generator on the reference); each is deterministic in the seed.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings

import torch

from pystronghold.kernels import reference as _ref

FORCE_ENV = "PYSTRONGHOLD_TRITON_ON_CPU"
_log = logging.getLogger(__name__)
_warned = False

__all__ = ["attention", "layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add",
           "vocab_parallel_cross_entropy", "uses_triton"]


def uses_triton(t: torch.Tensor) -> bool:
    """True when an op on tensor `t` runs the Triton kernels (CUDA, or CPU with PYSTRONGHOLD_TRITON_ON_CPU=1)."""
    global _warned
    if not (t.is_cuda or os.environ.get(FORCE_ENV) == "1"):
        return False
    if importlib.util.find_spec("triton") is None:
        if not _warned:
            _warned = True
            warnings.warn("triton is not installed: pystronghold.nn.functional uses the torch reference ops",
                          RuntimeWarning, stacklevel=3)
            _log.warning("triton is not installed; falling back to the torch reference ops")
        return False
    return True


def _kernel(name: str):
    return importlib.import_module(f"pystronghold.kernels.{name}")


def attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None):
    """softmax(q k^T * scale [+ causal mask]) v; q, k, v (B, H, N, D) -> (B, H, N, D) in q's dtype.

    scale defaults to 1/sqrt(D). Triton path: FlashAttention-2 (Dao 2023), 16 <= D <= 128, fp32
    accumulation; reference: `F.scaled_dot_product_attention`.
    """
    if uses_triton(q):
        return _kernel("attention").attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return _ref.attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias.

    x (..., N), weight and bias (N,) (bias may be None) -> (..., N) in x's dtype; fp32 statistics.
    """
    if uses_triton(x):
        return _kernel("norms").layer_norm(x, weight, bias, eps)
    return _ref.layer_norm_reference(x, weight, bias, eps)


def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm over the last dim (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight; (..., N)."""
    if uses_triton(x):
        return _kernel("norms").rms_norm(x, weight, eps)
    return _ref.rms_norm_reference(x, weight, eps)


def bias_gelu(x, bias, approximate: str = "tanh"):
    """gelu(x + bias) (Hendrycks & Gimpel 2016); x (..., N), bias (N,); approximate "tanh" or "none" (erf)."""
    if uses_triton(x):
        return _kernel("bias_gelu").bias_gelu(x, bias, approximate)
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate={approximate!r}: expected 'tanh' or 'none'")
    return _ref.bias_gelu_reference(x, bias, approximate)


def bias_dropout_add(x, bias, residual, *, p: float, training: bool, seed: int):
    """dropout(x + bias, p) + residual (Srivastava et al. 2014); x, residual (..., N), bias (N,) or None.

    The mask is a function of `seed` only (the backward regenerates it on the Triton path); with
    `training=False` no element is dropped.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1)")
    if uses_triton(x):
        return _kernel("bias_dropout_add").bias_dropout_add(x, bias, residual, p=p, training=training, seed=seed)
    return _ref.bias_dropout_add_reference(x, bias, residual, p=p, training=training, seed=seed)


def vocab_parallel_cross_entropy(logits_shard, target, *, group=None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean"):
    """Cross-entropy of logits sharded over the vocabulary across the ranks of `group` (Megatron-LM).

    logits_shard (T, V/tp): rank r holds vocabulary ids [r*V/tp, (r+1)*V/tp) (every rank the same width);
    target (T,) global ids, identical on every rank.
    Returns what `F.cross_entropy` returns on the full (T, V) logits (mean over non-ignored rows,
    "sum" or "none"), on every rank. With no process group (or one rank) it is `F.cross_entropy`.
    """
    if uses_triton(logits_shard):
        return _kernel("cross_entropy").vocab_parallel_cross_entropy(
            logits_shard, target, group=group, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction)
    return _ref.vocab_parallel_cross_entropy_reference(
        logits_shard, target, group=group, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction)
