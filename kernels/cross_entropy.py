"""Vocab-parallel cross-entropy in Triton (Megatron-LM's tensor-parallel loss, Shoeybi et al. 2019).

Rank r of the tensor-parallel group holds logits[:, r*V/tp : (r+1)*V/tp] (T rows). Per row:
  pass 1 (kernel): local max m_r, local sum s_r = sum_j exp(x_j - m_r), the target's logit if this
          rank holds it, and the sum of the local logits, in one read of the shard (online max);
  combine (torch.distributed): M = max_r m_r, S = sum_r s_r exp(m_r - M), lse = M + log S;
  pass 2 (kernel): loss = lse - (1 - eps) x_t - (eps / V) sum_j x_j (label smoothing eps, Szegedy et
          al. 2016), 0 on ignored rows, and in the same read the gradient
          dx_j = (exp(x_j - lse) - eps / V - (1 - eps) [j = t]) * scale, scale = 1/n_valid for "mean",
          without materialising the softmax.
The gradient is written during the forward into a new (T, V/tp) buffer (not in place of the logits);
backward only scales it by the incoming gradient. With one rank this is a fused cross-entropy.
Columns of global id >= vocab_size (padding, GPTConfig.vocab_pad_multiple) are masked: -inf in pass 1,
zero gradient in pass 2 (a shard of padding only is fine: its local max stays -inf, its sum 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from .reference import (check_vocab_size, combine_stats, reduce_loss,  # noqa: F401
                        vocab_parallel_cross_entropy_reference, world)

REDUCTIONS = ("mean", "sum", "none")

# ---- kernels


@triton.jit
def _ce_stats_kernel(X, T, M, S, TGT, SUMX, stride_x, n_cols, vocab_start, vocab, ignore_index,
                     BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    t = tl.load(T + row).to(tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    sum_x = tl.zeros([], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = (cols < n_cols) & (vocab_start + cols < vocab)  # padding columns count as -inf
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding so far: exp(-inf - 0) = 0, no NaN
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    local_t = t - vocab_start
    mine = (t != ignore_index) & (local_t >= 0) & (local_t < n_cols)
    tgt = tl.load(x_row + tl.where(mine, local_t, 0), mask=mine, other=0.0).to(tl.float32)
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(TGT + row, tgt)
    tl.store(SUMX + row, sum_x)


@triton.jit
def _ce_loss_grad_kernel(X, T, LSE, TGT, SUMX, SCALE, LOSS, DX, stride_x, stride_dx, n_cols, vocab_start,
                         vocab, ignore_index, eps, WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(T + row).to(tl.int64)
    valid = t != ignore_index
    lse = tl.load(LSE + row)
    loss = lse - (1.0 - eps) * tl.load(TGT + row) - eps / vocab * tl.load(SUMX + row)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(SCALE), 0.0)
        local_t = t - vocab_start
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = cols < n_cols
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - eps / vocab
            g = tl.where(cols == local_t, g - (1.0 - eps), g)
            g = tl.where(vocab_start + cols < vocab, g, 0.0)  # padding columns: no gradient
            tl.store(DX + row * stride_dx + cols, (g * scale).to(DX.dtype.element_ty), mask=mask)


# ---- launchers


def _block_v(n_cols: int, device: torch.device) -> int:
    # NOTE: smaller blocks under the interpreter only bound its memory; both sizes are valid on a GPU
    return min(1024 if _config.interpreting(device) else 4096, max(16, triton.next_power_of_2(n_cols)))


def ce_fwd(logits, target, group, ignore_index: int, label_smoothing: float, reduction: str, write_grad: bool,
           grad=None, vocab_size: int | None = None):
    """Both passes and the all_reduce; returns (loss rows (T,) fp32, valid rows, gradient or None).

    The gradient is written into contiguous `grad` when given. Columns of global id >= `vocab_size`
    (None: every column is real) are padding: no probability, zero gradient.
    """
    _config.check_dtype("logits_shard", logits)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits_shard (T, V/tp) and target (T,); got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    _config.check_runnable(logits.device, _ce_stats_kernel)
    rank, tp = world(group)
    vocab_size = check_vocab_size(vocab_size, logits.shape[1] * tp)
    logits = logits.contiguous()
    target = target.contiguous()
    n_rows, n_cols = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, s, tgt, sum_x = (torch.empty(n_rows, **f32) for _ in range(4))
    block_v = _block_v(n_cols, logits.device)
    if n_rows:
        _ce_stats_kernel[(n_rows,)](logits, target, m, s, tgt, sum_x, logits.stride(0), n_cols,
                                    rank * n_cols, vocab_size, ignore_index, BLOCK_V=block_v, num_warps=8)
    lse, tgt, sum_x = combine_stats(m, s, tgt, sum_x, group)
    valid = target != ignore_index
    n_valid = valid.sum()
    scale = (1.0 / n_valid.float() if reduction == "mean" else torch.ones((), **f32)).reshape(1).to(torch.float32)
    loss = torch.empty(n_rows, **f32)
    if write_grad and grad is None:
        grad = torch.empty_like(logits)
    if n_rows:
        _ce_loss_grad_kernel[(n_rows,)](logits, target, lse, tgt, sum_x, scale, loss,
                                        grad if write_grad else logits, logits.stride(0),
                                        grad.stride(0) if write_grad else 0, n_cols, rank * n_cols,
                                        vocab_size, ignore_index, label_smoothing, WRITE_GRAD=write_grad,
                                        BLOCK_V=block_v, num_warps=8)
    return loss, valid, grad


# ---- autograd


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction, vocab_size, loss_dtype):
        loss_rows, valid, grad = ce_fwd(logits, target, group, ignore_index, label_smoothing, reduction,
                                        write_grad=logits.requires_grad, vocab_size=vocab_size)
        ctx.save_for_backward(grad)
        ctx.reduction = reduction
        return reduce_loss(loss_rows, valid, reduction).to(loss_dtype or logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        if ctx.reduction == "none":
            dx = grad * grad_out.unsqueeze(1).to(grad.dtype)
        else:
            dx = grad * grad_out.to(grad.dtype)
        return dx, None, None, None, None, None, None, None


# ---- public


def vocab_parallel_cross_entropy(logits_shard, target, *, group=None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 vocab_size: int | None = None, loss_dtype: torch.dtype | None = None):
    """Triton cross-entropy of vocabulary-sharded logits: logits_shard (T, V/tp), target (T,) global ids.

    Rank r of `group` (None: one rank) holds vocabulary ids [r*V/tp, (r+1)*V/tp) (equal shards: V
    divisible by tp); ids >= `vocab_size` (None: V) are padding columns, given no probability. Returns
    the loss (a scalar, or (T,) for reduction="none") in `loss_dtype` (None: the logits' dtype), equal
    on every rank; matches `F.cross_entropy` on the full logits' real columns, including
    `ignore_index` and `label_smoothing`.
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index, label_smoothing, reduction,
                                            vocab_size, loss_dtype)
