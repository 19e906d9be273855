"""Flash attention (FlashAttention-2, Dao 2023) forward and backward in Triton.

O = softmax(Q K^T * scale [+ causal mask]) V for q, k, v of shape (B, H, N, D), 16 <= D <= 128, any N.
Forward: one program per (BLOCK_M query rows, batch*head); it streams BLOCK_N key/value rows with the
online softmax (running max m, running sum l, fp32 accumulator rescaled by exp(m_old - m_new)) and
saves LSE = m + log l (natural log, fp32, (B*H, N)). Exponentials use exp2 with log2(e) folded into
the scale. Causal programs stop at their diagonal block.
Backward (Delta = rowsum(dO * O), computed by torch): P = exp(S - LSE), dP = dO V^T,
dS = P (dP - Delta); dV = P^T dO, dK = scale dS^T Q in one pass per key block, dQ = scale dS K in a
second pass per query block (no atomics). Ragged edges (N, D not multiples of the blocks) are masked.
All accumulation is fp32. fp32 inputs use TF32 `tl.dot` on a GPU by default (about 1e-3 relative);
`input_precision="ieee"` makes every product exact fp32 there (slower; the interpreter is always exact).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _config
from .reference import attention_math_reference, attention_reference  # noqa: F401  (re-exported)

LOG2E = 1.4426950408889634
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
INPUT_PRECISIONS = ("tf32", "ieee")


def _interpreter_blocks(configs, named_args):
    """The one configuration used under the interpreter: blocks of 64, 32 or 16 rows by sequence length."""
    n = named_args["n_ctx"]
    block = 64 if n >= 128 else (32 if n >= 32 else 16)
    return triton.Config({"BLOCK_M": block, "BLOCK_N": block}, num_warps=4, num_stages=1)


def _configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


_FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)])
_BWD_CONFIGS = _configs([(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (32, 32, 4, 1)])
_AUTOTUNE = dict(key=["n_ctx", "head_dim", "CAUSAL", "PRECISION"],
                 prune_configs_by={"early_config_prune": _config.prune_to_one(_interpreter_blocks, "Q")})

# ---- kernels


@triton.jit
def _tile(rows, offs_d, n_ctx, head_dim):
    """Element offsets and in-bounds mask of the tile `rows` x `offs_d` of one row-major (n_ctx, head_dim) matrix."""
    offsets = rows[:, None] * head_dim + offs_d[None, :]
    mask = (rows < n_ctx)[:, None] & (offs_d < head_dim)[None, :]
    return offsets, mask


@triton.jit
def _load_tile(ptr, offsets, mask, UPCAST: tl.constexpr):
    """One tile, zero off the ragged edges; converted to fp32 if UPCAST (bf16 under the interpreter)."""
    x = tl.load(ptr + offsets, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_keys(K, V, base, cols, offs_d, n_ctx, head_dim, UPCAST: tl.constexpr):
    """The K and V tiles of key rows `cols` of one batch*head."""
    offsets, mask = _tile(cols, offs_d, n_ctx, head_dim)
    return _load_tile(K + base, offsets, mask, UPCAST), _load_tile(V + base, offsets, mask, UPCAST)


@triton.jit
def _load_queries(Q, DO, LSE, DELTA, base, bh, rows, offs_d, n_ctx, head_dim, UPCAST: tl.constexpr):
    """The backward's inputs for query rows `rows` of one batch*head: the Q and dO tiles, LSE and Delta (fp32)."""
    offsets, mask = _tile(rows, offs_d, n_ctx, head_dim)
    q = _load_tile(Q + base, offsets, mask, UPCAST)
    do = _load_tile(DO + base, offsets, mask, UPCAST)
    lse = tl.load(LSE + bh * n_ctx + rows, mask=rows < n_ctx, other=0.0)
    delta = tl.load(DELTA + bh * n_ctx + rows, mask=rows < n_ctx, other=0.0)
    return q, do, lse, delta


@triton.jit
def _keys_end(start_m, n_ctx, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """One past the last key that query block `start_m` attends to: causal blocks stop at their diagonal."""
    end = n_ctx
    if CAUSAL:
        end = tl.minimum((start_m + 1) * BLOCK_M, n_ctx)
    return end


@triton.autotune(configs=_FWD_CONFIGS, **_AUTOTUNE)
@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale, n_ctx, head_dim, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * n_ctx * head_dim
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_offs, q_mask = _tile(rows, offs_d, n_ctx, head_dim)
    q = _load_tile(Q + base, q_offs, q_mask, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _keys_end(start_m, n_ctx, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_keys(K, V, base, cols, offs_d, n_ctx, head_dim, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        valid = (cols < n_ctx)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                  # finite: column 0 is always valid
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + base + q_offs, acc.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + bh * n_ctx + rows, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=rows < n_ctx)


@triton.jit
def _attn_bwd_block(q, k, v, do, lse, delta, rows, cols, qk_scale, n_ctx, CAUSAL: tl.constexpr,
                    PRECISION: tl.constexpr):
    """P and dS of one (query block, key block) tile; both (BLOCK_M, BLOCK_N) fp32."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
    valid = (rows < n_ctx)[:, None] & (cols < n_ctx)[None, :]
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None])
    p = tl.where(valid, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.autotune(configs=_BWD_CONFIGS, **_AUTOTUNE)
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sm_scale, qk_scale, n_ctx, head_dim,
                          CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * n_ctx * head_dim
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _load_keys(K, V, base, cols, offs_d, n_ctx, head_dim, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M                 # first query block reaching these keys
    for start_m in range(lo, n_ctx, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q, do, lse, delta = _load_queries(Q, DO, LSE, DELTA, base, bh, rows, offs_d, n_ctx, head_dim, UPCAST)
        p, ds = _attn_bwd_block(q, k, v, do, lse, delta, rows, cols, qk_scale, n_ctx, CAUSAL, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    kv_offs, kv_mask = _tile(cols, offs_d, n_ctx, head_dim)
    tl.store(DK + base + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + base + kv_offs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.autotune(configs=_BWD_CONFIGS, **_AUTOTUNE)
@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sm_scale, qk_scale, n_ctx, head_dim,
                        CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * n_ctx * head_dim
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q, do, lse, delta = _load_queries(Q, DO, LSE, DELTA, base, bh, rows, offs_d, n_ctx, head_dim, UPCAST)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, _keys_end(start_m, n_ctx, CAUSAL, BLOCK_M), BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k, v = _load_keys(K, V, base, cols, offs_d, n_ctx, head_dim, UPCAST)
        p, ds = _attn_bwd_block(q, k, v, do, lse, delta, rows, cols, qk_scale, n_ctx, CAUSAL, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    q_offs, q_mask = _tile(rows, offs_d, n_ctx, head_dim)
    tl.store(DQ + base + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---- launchers


def _check(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _config.check_dtype(name, t)
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must all be (B, H, N, D) of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not MIN_HEAD_DIM <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(f"head dim D={q.shape[-1]} is out of range: the Triton attention takes "
                         f"{MIN_HEAD_DIM} <= D <= {MAX_HEAD_DIM}")
    _config.check_runnable(q.device, _attn_fwd_kernel)


def _precision(input_precision: str, dtype: torch.dtype) -> str:
    """The kernels' PRECISION: the request for fp32 inputs; "tf32" (Triton's default) for fp16/bf16,
    whose products are exact in the fp32 accumulator whatever the setting."""
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision must be one of {INPUT_PRECISIONS}, got {input_precision!r}")
    return input_precision if dtype == torch.float32 else "tf32"


def attention_fwd(q, k, v, causal: bool, sm_scale: float, o=None, input_precision: str = "tf32"):
    """Launch the forward; q, k, v (and `o` if given) contiguous (B, H, N, D). Returns (o, lse (B*H, N) fp32).

    input_precision: fp32 products on a GPU, "tf32" (tensor cores) or "ieee" (exact); no effect on
    fp16/bf16 inputs or in the interpreter.
    """
    precision = _precision(input_precision, q.dtype)
    batch, heads, n_ctx, head_dim = q.shape
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(batch * heads, n_ctx, dtype=torch.float32, device=q.device)
    if q.numel():
        grid = lambda meta: (triton.cdiv(n_ctx, meta["BLOCK_M"]), batch * heads)  # noqa: E731
        _attn_fwd_kernel[grid](q, k, v, o, lse, sm_scale * LOG2E, n_ctx, head_dim, CAUSAL=causal,
                               UPCAST=_config.upcast_for_dot(q.dtype, q.device), PRECISION=precision,
                               BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return o, lse


def attention_bwd(do, q, k, v, o, lse, causal: bool, sm_scale: float, grads=None, input_precision: str = "tf32"):
    """Launch the two backward passes; returns (dq, dk, dv) in q's dtype (into contiguous `grads` if given).

    input_precision as in `attention_fwd`.
    """
    precision = _precision(input_precision, q.dtype)
    batch, heads, n_ctx, head_dim = q.shape
    do = do.contiguous()
    delta = (o.float() * do.float()).sum(-1).reshape(batch * heads, n_ctx)   # (B*H, N) fp32
    dq, dk, dv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if grads is None else grads
    if q.numel():
        args = dict(CAUSAL=causal, UPCAST=_config.upcast_for_dot(q.dtype, q.device), PRECISION=precision,
                    BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
        grid_n = lambda meta: (triton.cdiv(n_ctx, meta["BLOCK_N"]), batch * heads)  # noqa: E731
        _attn_bwd_dkdv_kernel[grid_n](q, k, v, do, lse, delta, dk, dv, sm_scale, sm_scale * LOG2E,
                                      n_ctx, head_dim, **args)
        grid_m = lambda meta: (triton.cdiv(n_ctx, meta["BLOCK_M"]), batch * heads)  # noqa: E731
        _attn_bwd_dq_kernel[grid_m](q, k, v, do, lse, delta, dq, sm_scale, sm_scale * LOG2E, n_ctx, head_dim,
                                    **args)
    return dq, dk, dv


# ---- autograd


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, input_precision):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = attention_fwd(q, k, v, causal, sm_scale, input_precision=input_precision)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.input_precision = causal, sm_scale, input_precision
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.sm_scale,
                                   input_precision=ctx.input_precision)
        return dq, dk, dv, None, None, None


# ---- public


def attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None, input_precision: str = "tf32"):
    """Triton flash attention: softmax(q k^T * scale) v, (B, H, N, D) -> (B, H, N, D), 16 <= D <= 128.

    scale defaults to 1/sqrt(D); `causal` masks key j > query i (queries and keys aligned at 0).
    fp32/fp16/bf16 inputs, fp32 accumulation; output in the inputs' dtype (FlashAttention-2, Dao 2023).
    input_precision: fp32 products on a GPU, "tf32" (default, tensor cores, about 1e-3 relative) or
    "ieee" (exact fp32, slower); no effect on fp16/bf16 inputs or in the interpreter.
    """
    _check(q, k, v)
    precision = _precision(input_precision, q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _AttentionFunction.apply(q, k, v, bool(causal), float(scale), precision)
