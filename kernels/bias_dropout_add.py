"""Bias + dropout + residual add: the epilogue of a row-parallel linear, in Triton.

out = dropout(x + b, p) + residual, dropout(z)_i = z_i * keep_i / (1 - p), keep_i = (u_i >= p), with
u_i = Philox uniform(seed, offset + i) over the flat element index i (Srivastava et al. 2014 for
dropout; Salmon et al. 2011 for Philox). Nothing is stored: the backward regenerates keep from
(seed, offset), so dx = dy * keep / (1 - p), dresidual = dy, db = column sum of dx.
Identical (seed, offset) give identical masks on a given device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from .reference import bias_dropout_add_reference  # noqa: F401  (re-exported)


# ---- kernels


@_config.elementwise_autotune("X")
@triton.jit
def _bias_dropout_add_fwd_kernel(X, B, R, Y, n_elements, n_cols, p, seed, offset,
                                 HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offset + offs) >= p
    z = tl.where(keep, z / (1.0 - p), 0.0)
    r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (z + r).to(Y.dtype.element_ty), mask=mask)


@_config.elementwise_autotune("DY")
@triton.jit
def _bias_dropout_add_bwd_kernel(DY, DX, n_elements, p, seed, offset, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    keep = tl.rand(seed, offset + offs) >= p
    tl.store(DX + offs, tl.where(keep, dy / (1.0 - p), 0.0).to(DX.dtype.element_ty), mask=mask)


# ---- launchers


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def _check(x, bias, residual, p):
    _config.check_dtype("x", x)
    _config.check_dtype("residual", residual)
    if bias is not None:
        _config.check_dtype("bias", bias)
        if bias.shape != (x.shape[-1],):
            raise ValueError(f"bias must have shape ({x.shape[-1]},); got {tuple(bias.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must be in [0, 1)")
    _config.check_runnable(x.device, _bias_dropout_add_fwd_kernel)


def bias_dropout_add_fwd(x, bias, residual, p: float, seed: int, offset: int = 0, y=None):
    """Launch the forward (p = 0 for evaluation); returns out in x's dtype (into contiguous `y` if given)."""
    _check(x, bias, residual, p)
    x, residual = x.contiguous(), residual.contiguous()
    y = torch.empty_like(x) if y is None else y
    n = x.numel()
    if n:
        _bias_dropout_add_fwd_kernel[_grid(n)](
            x, x if bias is None else bias.contiguous(), residual, y, n, x.shape[-1], p, seed, offset,
            HAS_BIAS=bias is not None)
    return y


def bias_dropout_add_bwd(dy, p: float, seed: int, offset: int = 0, dx=None):
    """Launch the backward: dx = dy * keep / (1 - p) with keep regenerated from (seed, offset)."""
    dy = dy.contiguous()
    dx = torch.empty_like(dy) if dx is None else dx
    n = dy.numel()
    if n:
        _bias_dropout_add_bwd_kernel[_grid(n)](dy, dx, n, p, seed, offset)
    return dx


# ---- autograd


class _BiasDropoutAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p, seed, offset):
        y = bias_dropout_add_fwd(x, bias, residual, p, seed, offset)
        ctx.p, ctx.seed, ctx.offset, ctx.has_bias = p, seed, offset, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = bias_dropout_add_bwd(dy, ctx.p, ctx.seed, ctx.offset)
        db = dx.reshape(-1, dx.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.to(ctx.x_dtype), db, dy.to(ctx.r_dtype), None, None, None


# ---- public


def bias_dropout_add(x, bias, residual, *, p: float, training: bool, seed: int, offset: int = 0):
    """Triton dropout(x + bias, p) + residual: x, residual (..., N), bias (N,) or None -> (..., N).

    `seed` and `offset` (int) select the Philox stream; evaluation (`training=False`) uses p = 0.
    """
    return _BiasDropoutAddFunction.apply(x, bias, residual, p if training else 0.0, int(seed), int(offset))
