"""Pure-torch references of the fused ops: the CPU path of `pystronghold.nn.functional`, and torch's side
of its dispatch on CUDA (`pystronghold.nn.dispatch`).

NOTE: these live apart from the Triton op files (which re-export them) so that the CPU path never
imports triton and never decorates a kernel: importing a kernel module freezes Triton's choice
between compiling and interpreting (see `_config`), and a model trained on CPU must not make it.
Every function here is plain, differentiable torch; the math is done in fp32 and cast back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

# ---- attention


def attention_reference(q, k, v, *, causal: bool = True, softmax_scale: float | None = None):
    """softmax(q k^T * scale [+ causal mask]) v with torch's fused SDPA. (B, H, N, D) -> (B, H, N, D)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)


def attention_math_reference(q, k, v, *, causal: bool = True, softmax_scale: float | None = None):
    """The same as `attention_reference`, written out in fp32 for tests: S = q k^T * scale, P = softmax(S)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, N, N)
    if causal:
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


# ---- norms


def layer_norm_reference(x, weight, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (Ba et al. 2016)."""
    if x.is_cuda and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        # NOTE: on CUDA, what nn.LayerNorm runs (fp32 statistics inside, no fp32 copies): the
        # baseline the dispatch must match. CPU keeps the fp32 form: native bf16/fp16 rounds a few
        # elements differently, and CPU results (golden losses) stay as they were.
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(),
                     None if bias is None else bias.float(), eps)
    return y.to(x.dtype)


def rms_norm_reference(x, weight, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Zhang & Sennrich 2019)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


# ---- bias + GeLU


def bias_gelu_reference(x, bias, approximate: str = "tanh"):
    """gelu(x + bias); "tanh" is the tanh approximation, "none" the exact erf form (Hendrycks & Gimpel)."""
    return F.gelu(x.float() + bias.float(), approximate=approximate).to(x.dtype)


# ---- bias + dropout + residual


def bias_dropout_add_reference(x, bias, residual, *, p: float, training: bool, seed: int):
    """dropout(x + bias, p) + residual; the mask comes from torch's CPU generator seeded with `seed`.

    The mask differs from the Triton kernel's (Philox) mask for the same seed; each is deterministic.
    """
    z = x.float() if bias is None else x.float() + bias.float()
    if training and p > 0.0:
        gen = torch.Generator(device=x.device).manual_seed(int(seed))
        keep = torch.rand(z.shape, generator=gen, device=x.device) >= p
        z = z * keep / (1.0 - p)
    return (z + residual.float()).to(x.dtype)


# ---- vocab-parallel cross-entropy


def world(group) -> tuple[int, int]:
    """(rank, world size) of `group`; (0, 1) for None (no parallelism, as in `pystronghold.parallel`)
    or when torch.distributed is not initialised."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def combine_stats(m, s, target_logit, sum_logits, group):
    """All-reduce per-row stats of the local vocabulary slices into global ones.

    m: local max (-inf on a shard of padding only), s: local sum of exp(x - m), target_logit: the
    target's logit on the rank holding it (0 elsewhere), sum_logits: sum of the local logits; all (T,)
    fp32. Returns (lse, target_logit, sum_logits) over the full vocabulary; one MAX then one SUM
    all_reduce.
    """
    if world(group)[1] > 1:
        m_global = m.clone()
        dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
        packed = torch.stack([s * torch.exp(m - m_global), target_logit, sum_logits])  # (3, T)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        s, target_logit, sum_logits = packed.unbind(0)
        m = m_global
    return m + torch.log(s), target_logit, sum_logits


def reduce_loss(loss_rows, valid, reduction: str):
    """Apply `reduction` ("mean" over non-ignored rows, "sum", "none") to per-row losses."""
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / valid.sum()


def real_columns(n_cols: int, rank: int, vocab_size: int, device) -> torch.Tensor:
    """(n_cols,) bool: which columns of rank `rank`'s shard are vocabulary ids < vocab_size (the rest
    is padding, e.g. GPTConfig.vocab_pad_multiple)."""
    return torch.arange(rank * n_cols, (rank + 1) * n_cols, device=device) < vocab_size


class _VocabParallelCrossEntropyTorch(torch.autograd.Function):
    """Torch version of the vocab-parallel cross-entropy: same stats and all_reduce as the kernels."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, reduction, vocab_size, loss_dtype):
        rank, _ = world(group)
        vocab_local = logits.shape[-1]
        real = real_columns(vocab_local, rank, vocab_size, logits.device)
        x = logits.float().masked_fill(~real, float("-inf"))            # (T, V/tp), padding -> -inf
        local_t = target - rank * vocab_local
        valid = target != ignore_index
        mine = valid & (local_t >= 0) & (local_t < vocab_local)
        idx = local_t.clamp(0, vocab_local - 1).unsqueeze(1)
        m = x.max(dim=-1).values
        m_finite = torch.where(torch.isneginf(m), 0.0, m)                # a shard of padding only: s = 0
        s = torch.exp(x - m_finite.unsqueeze(1)).sum(-1)
        tgt = torch.where(mine, x.gather(1, idx).squeeze(1), torch.zeros_like(m))
        lse, tgt, sum_x = combine_stats(m, s, tgt, torch.where(real, x, 0.0).sum(-1), group)
        eps = label_smoothing
        loss_rows = torch.where(valid, lse - (1 - eps) * tgt - eps / vocab_size * sum_x, torch.zeros_like(lse))
        ctx.save_for_backward(logits, lse, idx, mine, valid, real)
        ctx.eps, ctx.vocab, ctx.reduction = eps, vocab_size, reduction
        return reduce_loss(loss_rows, valid, reduction).to(loss_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        logits, lse, idx, mine, valid, real = ctx.saved_tensors
        g = torch.exp(logits.float() - lse.unsqueeze(1)) - ctx.eps / ctx.vocab  # softmax - smoothing
        g.scatter_add_(1, idx, torch.where(mine, -(1 - ctx.eps), 0.0).unsqueeze(1).to(g.dtype))
        scale = grad_out.float() if ctx.reduction == "none" else grad_out.float().expand(valid.shape)
        if ctx.reduction == "mean":
            scale = scale / valid.sum()
        g = g * torch.where(valid, scale, 0.0).unsqueeze(1) * real           # padding: no gradient
        return g.to(logits.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy_reference(logits_shard, target, *, group=None, ignore_index: int = -100,
                                           label_smoothing: float = 0.0, reduction: str = "mean",
                                           vocab_size: int | None = None, loss_dtype: torch.dtype | None = None):
    """Cross-entropy of logits split over the vocabulary across the ranks of `group` (torch version).

    Arguments as `pystronghold.nn.functional.vocab_parallel_cross_entropy`. With one rank this is
    `F.cross_entropy` on the real columns (in `loss_dtype`); with more, the same math as the Triton
    kernels (local max and sum-exp, all_reduce, loss = lse - (1-eps) x_t - eps/V sum_j x_j).
    """
    rank, tp = world(group)
    vocab_size = check_vocab_size(vocab_size, logits_shard.shape[-1] * tp)
    loss_dtype = loss_dtype or logits_shard.dtype
    if tp == 1:
        return F.cross_entropy(logits_shard[:, :vocab_size].to(loss_dtype), target, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
    return _VocabParallelCrossEntropyTorch.apply(logits_shard, target, group, ignore_index,
                                                 label_smoothing, reduction, vocab_size, loss_dtype)


def check_vocab_size(vocab_size: int | None, columns: int) -> int:
    """`vocab_size` (None: all `columns`), checked to be in 1..columns (ValueError otherwise)."""
    if vocab_size is None:
        return columns
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= columns:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int in 1..{columns} (the columns over all ranks)")
    return vocab_size
