"""LayerNorm and RMSNorm over the last dimension: Triton forward and backward.

LayerNorm (Ba et al. 2016): y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var + eps).
RMSNorm (Zhang & Sennrich 2019): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
One program normalises one row (the whole row is one block, up to 16K wide); mean and rstd (fp32)
are saved. Backward, with xhat the normalised row and g = w * dy:
  dx = (g - xhat * mean(xhat * g) - [LayerNorm] mean(g)) * rstd,  dw = sum_rows dy * xhat,  db = sum_rows dy.
The backward runs a fixed number of persistent programs, each summing dw/db over its rows in
registers; their fp32 partial sums are added by torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from .reference import layer_norm_reference, rms_norm_reference  # noqa: F401  (re-exported)

MAX_WIDTH = 16384

# num_warps is timed on a GPU per width (the row is one block); the first is kept under the interpreter.
_CONFIGS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]

# ---- kernels


@triton.autotune(configs=_CONFIGS, key=["n_cols"],
                 prune_configs_by={"early_config_prune": _config.prune_to_one(lambda c, _: c[0], "X")})
@triton.jit
def _norm_fwd_kernel(X, W, B, Y, Mean, Rstd, stride_x, stride_y, n_cols, eps,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        mean = 0.0
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.autotune(configs=_CONFIGS, key=["n_cols"],
                 prune_configs_by={"early_config_prune": _config.prune_to_one(lambda c, _: c[0], "X")})
@triton.jit
def _norm_bwd_kernel(DY, X, W, Mean, Rstd, DX, DW_partial, DB_partial, stride_x, n_rows, n_cols,
                     rows_per_program, IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
        g = w * dy
        dx = g - xhat * (tl.sum(xhat * g, axis=0) / n_cols)
        if not IS_RMS:
            dx -= tl.sum(g, axis=0) / n_cols
        tl.store(DX + row * stride_x + cols, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(DW_partial + pid * n_cols + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_partial + pid * n_cols + cols, db_acc, mask=mask)


# ---- launchers


def _check(x, weight, bias):
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None:
            _config.check_dtype(name, t)
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"weight/bias must have shape ({n},) to match x's last dim; got "
                         f"{tuple(weight.shape)} / {None if bias is None else tuple(bias.shape)}")
    if not 1 <= n <= MAX_WIDTH:
        raise ValueError(f"norm width {n} is out of range: the Triton norms take 1..{MAX_WIDTH} columns")
    _config.check_runnable(x.device, _norm_fwd_kernel)


def norm_fwd(x, weight, bias, eps: float, is_rms: bool, y=None):
    """Launch the forward: returns y (shape of x; written into `y` when given) and (x2d, mean, rstd)."""
    _check(x, weight, bias)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()                    # (M, N)
    m, n = x2d.shape
    y = torch.empty_like(x2d) if y is None else y.view(m, n)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block_n = max(16, triton.next_power_of_2(n))
    if m > 0:
        _norm_fwd_kernel[(m,)](x2d, weight, weight if bias is None else bias, y, mean, rstd,
                               x2d.stride(0), y.stride(0), n, eps, IS_RMS=is_rms,
                               HAS_BIAS=bias is not None, BLOCK_N=block_n)
    return y.view(x.shape), (x2d, mean, rstd)


def norm_bwd(dy, x2d, weight, mean, rstd, has_bias: bool, is_rms: bool, dx=None):
    """Launch the backward: returns (dx2d, dw, db or None); dx2d is written into `dx` when given."""
    m, n = x2d.shape
    dy2d = dy.reshape(m, n).contiguous()
    dx = torch.empty_like(x2d) if dx is None else dx.view(m, n)
    programs = max(1, min(m, _config.grid_programs(x2d.device)))
    rows_per_program = triton.cdiv(m, programs) if m else 0
    dw_part = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device)
    db_part = torch.zeros(programs, n, dtype=torch.float32, device=x2d.device) if has_bias else dw_part
    block_n = max(16, triton.next_power_of_2(n))
    if m > 0:
        _norm_bwd_kernel[(programs,)](dy2d, x2d, weight, mean, rstd, dx, dw_part, db_part, x2d.stride(0),
                                      m, n, rows_per_program, IS_RMS=is_rms, HAS_BIAS=has_bias,
                                      BLOCK_N=block_n)
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(weight.dtype) if has_bias else None
    return dx, dw, db


# ---- autograd


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        y, (x2d, mean, rstd) = norm_fwd(x, weight, bias, eps, is_rms)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias, ctx.is_rms, ctx.x_shape = bias is not None, is_rms, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = norm_bwd(dy, x2d, weight, mean, rstd, ctx.has_bias, ctx.is_rms)
        return dx.view(ctx.x_shape), dw, db, None, None


# ---- public


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """Triton LayerNorm over the last dim: (..., N) -> (..., N), N <= 16384, same dtype as x.

    y = (x - mean) / sqrt(var + eps) * weight + bias (biased variance; Ba et al. 2016). `bias` may be None.
    """
    return _NormFunction.apply(x, weight, bias, eps, False)


def rms_norm(x, weight, eps: float = 1e-6):
    """Triton RMSNorm over the last dim: y = x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019)."""
    return _NormFunction.apply(x, weight, None, eps, True)
