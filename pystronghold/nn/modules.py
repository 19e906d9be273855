"""Drop-in `nn.Module`s over `pystronghold.nn.functional` (Triton on CUDA, torch on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as PF


def _width(dim) -> int:
    """`dim` as an int; a 1-tuple (torch.nn.LayerNorm's normalized_shape) is accepted too."""
    if isinstance(dim, (tuple, list, torch.Size)):
        if len(dim) != 1:
            raise ValueError(f"dim={tuple(dim)}: only normalisation over the last dim is supported")
        dim = dim[0]
    if int(dim) < 1:
        raise ValueError(f"dim={dim} must be positive")
    return int(dim)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim of width `dim`, like `torch.nn.LayerNorm(dim, eps, bias=bias)`."""

    def __init__(self, dim, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = _width(dim), eps
        dim = self.dim
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        return PF.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dim of width `dim`: x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = _width(dim), eps
        dim = self.dim
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        return PF.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
