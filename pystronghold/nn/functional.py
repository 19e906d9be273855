"""Fused ops of the GPT blocks: our Triton kernels or torch's own path, whichever is faster.

Each function takes the same arguments and is differentiable on both paths: the kernels of
``pystronghold.kernels`` or the pure-torch references of ``pystronghold.kernels.reference``.
``pystronghold.nn.dispatch`` chooses (``PYSTRONGHOLD_TRITON_ON_CPU``, ``PYSTRONGHOLD_KERNELS``).
Inputs Triton cannot take (dtype, head dim outside 16..128, norm width over 16384, mismatched
shapes) raise ValueError on the Triton path. Without triton, CUDA tensors fall back to the
reference with a one-time warning. Dropout masks differ between the paths; each is seeded.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import warnings

import torch

from pystronghold.kernels import reference as _ref

from . import dispatch

FORCE_ENV = "PYSTRONGHOLD_TRITON_ON_CPU"
_log = logging.getLogger(__name__)
_warned = False

__all__ = ["attention", "layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add",
           "vocab_parallel_cross_entropy", "triton_available"]


def triton_available(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on tensor `t`: CUDA, or CPU with PYSTRONGHOLD_TRITON_ON_CPU=1,
    and triton installed (warns once when it is not)."""
    global _warned
    if not (t.is_cuda or (t.device.type == "cpu" and os.environ.get(FORCE_ENV) == "1")):
        return False
    if importlib.util.find_spec("triton") is None:
        if not _warned:
            _warned = True
            warnings.warn("triton is not installed: pystronghold.nn.functional uses the torch reference ops",
                          RuntimeWarning, stacklevel=4)
            _log.warning("triton is not installed; falling back to the torch reference ops")
        return False
    return True


def _kernel(name: str):
    return importlib.import_module(f"pystronghold.kernels.{name}")


def _triton(module: str, fn: str):
    """The public Triton function `fn` of kernel module `module`, imported when first called."""
    return lambda *args, **kwargs: getattr(_kernel(module), fn)(*args, **kwargs)


def _rows(x: torch.Tensor) -> int:
    """Rows of a (..., N) tensor, bucketed to a power of two (the size part of a shape class)."""
    return dispatch.size_bucket(x.numel() // max(1, x.shape[-1])) if x.dim() else 1


def _run(op: str, key: tuple, triton_fn, torch_fn, *args, **kwargs):
    """Run `op` on the path the dispatch picks for `args` (shape class `key`; see the module docstring).

    PYSTRONGHOLD_KERNELS is validated at every call, on every device.
    """
    mode = dispatch.parse_modes(os.environ.get(dispatch.ENV, ""))[op]
    candidates = {"triton": triton_fn, "torch": torch_fn}
    path = "torch"
    if triton_available(args[0]):
        path = dispatch.DISPATCHER.path(op, mode, args[0].device, key, candidates, args, kwargs)
    return candidates[path](*args, **kwargs)


def attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None):
    """softmax(q k^T * scale [+ causal mask]) v; q, k, v (B, H, N, D) -> (B, H, N, D) in q's dtype.

    scale defaults to 1/sqrt(D). Triton path: FlashAttention-2 (Dao 2023), 16 <= D <= 128, fp32
    accumulation; reference: `F.scaled_dot_product_attention`.
    """
    n, d = (q.shape[-2], q.shape[-1]) if q.dim() >= 2 else (1, q.numel())
    key = (q.dtype, causal, d, dispatch.size_bucket(n), dispatch.size_bucket(q.numel() // max(1, n * d)))
    return _run("attention", key, _triton("attention", "attention"), _ref.attention_reference, q, k, v,
                causal=causal, softmax_scale=softmax_scale)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm over the last dim (Ba et al. 2016): (x - mean) / sqrt(var + eps) * weight + bias.

    x (..., N), weight and bias (N,) (bias may be None) -> (..., N) in x's dtype; fp32 statistics.
    """
    key = (x.dtype, x.shape[-1], _rows(x), bias is not None)
    return _run("layer_norm", key, _triton("norms", "layer_norm"), _ref.layer_norm_reference, x, weight, bias, eps)


def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm over the last dim (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight; (..., N)."""
    key = (x.dtype, x.shape[-1], _rows(x))
    return _run("rms_norm", key, _triton("norms", "rms_norm"), _ref.rms_norm_reference, x, weight, eps)


def bias_gelu(x, bias, approximate: str = "tanh"):
    """gelu(x + bias) (Hendrycks & Gimpel 2016); x (..., N), bias (N,); approximate "tanh" or "none" (erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate={approximate!r}: expected 'tanh' or 'none'")
    key = (x.dtype, x.shape[-1], _rows(x), approximate)
    return _run("bias_gelu", key, _triton("bias_gelu", "bias_gelu"), _ref.bias_gelu_reference, x, bias, approximate)


def bias_dropout_add(x, bias, residual, *, p: float, training: bool, seed: int):
    """dropout(x + bias, p) + residual (Srivastava et al. 2014); x, residual (..., N), bias (N,) or None.

    The mask is a function of `seed` only (the backward regenerates it on the Triton path); with
    `training=False` no element is dropped.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1)")
    key = (x.dtype, x.shape[-1], _rows(x), bias is not None, training and p > 0.0)
    return _run("bias_dropout_add", key, _triton("bias_dropout_add", "bias_dropout_add"),
                _ref.bias_dropout_add_reference, x, bias, residual, p=p, training=training, seed=seed)


def vocab_parallel_cross_entropy(logits_shard, target, *, group=None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 vocab_size: int | None = None, loss_dtype: torch.dtype | None = None):
    """Cross-entropy of logits sharded over the vocabulary across the ranks of `group` (Megatron-LM).

    logits_shard (T, V/tp): rank r holds vocabulary ids [r*V/tp, (r+1)*V/tp) (every rank the same width);
    target (T,) global ids, identical on every rank. `group` None means one rank (as in
    `pystronghold.parallel`). Ids >= `vocab_size` (None: V) are padding columns: no probability, zero
    gradient. Returns what `F.cross_entropy` returns on the full (T, V) logits' real columns (mean over
    non-ignored rows, "sum" or "none"), in `loss_dtype` (None: the logits' dtype; the math is fp32),
    on every rank. With one rank the torch path is `F.cross_entropy`.
    """
    key = (logits_shard.dtype, logits_shard.shape[-1], _rows(logits_shard), _ref.world(group)[1])
    return _run("vocab_parallel_cross_entropy", key, _triton("cross_entropy", "vocab_parallel_cross_entropy"),
                _ref.vocab_parallel_cross_entropy_reference, logits_shard, target, group=group,
                ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
                vocab_size=vocab_size, loss_dtype=loss_dtype)
