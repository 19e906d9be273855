"""Bias + GeLU: the epilogue of a column-parallel linear, forward and backward in Triton.

y = gelu(x + b) over (..., N) with b of shape (N,) (Hendrycks & Gimpel 2016):
  exact ("none"): gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt 2)),
                  gelu'(z) = Phi(z) + z * exp(-z^2 / 2) / sqrt(2 pi)
  tanh ("tanh"):  gelu(z) = 0.5 z (1 + t), t = tanh(k (z + 0.044715 z^3)), k = sqrt(2 / pi),
                  gelu'(z) = 0.5 (1 + t) + 0.5 z (1 - t^2) k (1 + 3 * 0.044715 z^2)
tanh is written 2 sigmoid(2u) - 1 (libdevice's tanh is unavailable in the interpreter, and this form
is exact). Backward recomputes z from the saved input; db is the column sum of dx (torch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _config
from .reference import bias_gelu_reference  # noqa: F401  (re-exported)

APPROXIMATIONS = ("tanh", "none")

# ---- kernels


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@_config.elementwise_autotune("X")
@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, n_elements, n_cols, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        y = 0.5 * z * (1.0 + _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)))
    else:
        y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@_config.elementwise_autotune("DY")
@triton.jit
def _bias_gelu_bwd_kernel(DY, X, B, DX, n_elements, n_cols, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(B + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        k = 0.7978845608028654
        t = _tanh(k * (z + 0.044715 * z * z * z))
        dgelu = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z)
    else:
        dgelu = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    tl.store(DX + offs, (dy * dgelu).to(DX.dtype.element_ty), mask=mask)


# ---- launchers


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def _check(x, bias, approximate):
    _config.check_dtype("x", x)
    _config.check_dtype("bias", bias)
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r}: expected 'tanh' or 'none'")
    if bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must have shape ({x.shape[-1]},) to match x's last dim; got {tuple(bias.shape)}")
    _config.check_runnable(x.device, _bias_gelu_fwd_kernel)


def bias_gelu_fwd(x, bias, approximate: str, y=None):
    """Launch the forward; returns y (shape and dtype of x), written into contiguous `y` when given."""
    _check(x, bias, approximate)
    x = x.contiguous()
    y = torch.empty_like(x) if y is None else y
    n = x.numel()
    if n:
        _bias_gelu_fwd_kernel[_grid(n)](x, bias.contiguous(), y, n, x.shape[-1],
                                                        TANH=approximate == "tanh")
    return y


def bias_gelu_bwd(dy, x, bias, approximate: str, dx=None):
    """Launch the backward; returns (dx, db), dx written into contiguous `dx` when given."""
    x = x.contiguous()
    dy = dy.contiguous()
    dx = torch.empty_like(x) if dx is None else dx
    n = x.numel()
    if n:
        _bias_gelu_bwd_kernel[_grid(n)](dy, x, bias.contiguous(), dx, n, x.shape[-1],
                                                        TANH=approximate == "tanh")
    db = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, db


# ---- autograd


class _BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate):
        y = bias_gelu_fwd(x, bias, approximate)
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = bias_gelu_bwd(dy, x, bias, ctx.approximate)
        return dx, db, None


# ---- public


def bias_gelu(x, bias, approximate: str = "tanh"):
    """Triton gelu(x + bias): x (..., N), bias (N,) -> (..., N) in x's dtype; approximate "tanh" | "none"."""
    return _BiasGeluFunction.apply(x, bias, approximate)
