"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Each layer holds this rank's slice of the full weight, with the same parameter names as the plain
torch layer (``weight`` (out, in), ``bias``). A split parameter carries ``tp_split = (dim, rank,
size)``: ``init_normal_`` draws the *full* tensor from a seed and keeps the slice, so a run with any
TP size starts from exactly the single-process weights, and ``gather_tp_param`` rebuilds the full
tensor (``gather_tp_tensor`` that of any tensor shaped like the slice, e.g. an Adam moment;
``tp_slice`` cuts a rank's slice out of a full tensor, ``tp_shard_parameter`` makes it a parameter). With ``group=None`` (or a one-rank group)
every layer is its plain torch counterpart.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pystronghold.parallel.groups import group_rank, group_size
from pystronghold.parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                            reduce_from_tp_region, scatter_to_tp_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "init_normal_", "gather_tp_param", "gather_tp_tensor", "tp_slice", "tp_shard_parameter",
           "mark_tp_split"]


# ---- split parameters: init and gather

def mark_tp_split(param: nn.Parameter, dim: int, group: dist.ProcessGroup | None, parts: int = 1) -> nn.Parameter:
    """Tag ``param`` as this rank's slice along ``dim`` of a tensor split across ``group``; ``parts`` > 1:
    ``dim`` packs that many equal parts, each split so (a packed split: ``tp_slice``)."""
    param.tp_split = (dim, group_rank(group), group_size(group), *((parts,) if parts > 1 else ()))
    return param


@torch.no_grad()
def init_normal_(param: torch.Tensor, std: float, seed: int, name: str) -> torch.Tensor:
    """Fill ``param`` with N(0, std) from a CPU generator seeded by (``seed``, ``name``).

    For a split parameter (``tp_split``) the full tensor is drawn and this rank's slice kept: the
    values do not depend on the TP size. Returns ``param``. A ``meta`` parameter is returned
    untouched: it has no storage to fill, and drawing the full tensor on the host anyway is the
    cost that building on ``meta`` avoids (``GPT(..., materialize_blocks=False)``).
    """
    if param.is_meta:
        return param
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    shape = list(param.shape)
    dim, rank, size = getattr(param, "tp_split", (0, 0, 1))
    if size == 1 and param.dtype == torch.float32 and param.is_contiguous():
        # NOTE: drawn in place: the same values as the general path below, bit for bit (same
        # generator, same contiguous fill, the same multiply), without two temporaries of the
        # parameter's size, each page-faulted in and written once more. out= refuses a leaf that
        # requires grad, hence detach() (same storage).
        torch.randn(shape, generator=gen, dtype=torch.float32, out=param.detach())
        return param.mul_(std)
    shape[dim] *= size
    full = torch.randn(shape, generator=gen, dtype=torch.float32) * std  # (full shape)
    param.copy_(full.narrow(dim, rank * param.shape[dim], param.shape[dim]))
    return param


@torch.no_grad()
def gather_tp_param(param: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of a split parameter, gathered from every rank of ``group`` (a collective:
    every rank must call it). Unsplit parameters are returned detached as they are."""
    return gather_tp_tensor(param.detach(), getattr(param, "tp_split", (0, 0, 1)), group)


@torch.no_grad()
def gather_tp_tensor(local: torch.Tensor, split: tuple[int, ...],
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's slice as described by ``split = (dim,
    rank, size)`` or a packed ``(dim, rank, size, parts)`` (``tp_slice``; a parameter's ``tp_split``,
    also that of its Adam moments and fp32 master), gathered from every rank of ``group`` (a
    collective when size > 1). With size 1, ``local`` itself. On an NCCL group the tensor travels
    through the current CUDA device and comes back where it was."""
    dim, _, size, *packed = split
    if size == 1:
        return local
    if size != group_size(group):
        raise ValueError(f"tensor is split {size} ways but the group has {group_size(group)} ranks")
    where = local.device
    local = local.contiguous()
    if dist.get_backend(group) == "nccl" and where.type != "cuda":
        local = local.cuda()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    if packed:  # each rank's slice holds a piece of every part: (.., parts * n/size, ..) -> (.., parts, n/size, ..)
        whole = torch.cat([part.unflatten(dim, (packed[0], -1)) for part in parts], dim=dim + 1)
        return whole.flatten(dim, dim + 1).to(where)
    return torch.cat(parts, dim=dim).to(where)


def tp_slice(full: torch.Tensor, split: tuple[int, ...]) -> torch.Tensor:
    """This rank's slice of the whole tensor ``full`` for ``split = (dim, rank, size)`` (a view;
    ``full`` itself when size is 1): rows ``[rank * n/size, (rank+1) * n/size)`` along ``dim``.
    A packed split ``(dim, rank, size, parts)``: ``dim`` holds ``parts`` equal parts (an MoE's
    ``[gate; up]``), each split so; the slice is this rank's rows of every part, in order (a copy)."""
    dim, rank, size, *packed = split
    if size == 1:
        return full
    parts = packed[0] if packed else 1
    if full.shape[dim] % (size * parts):
        raise ValueError(f"dimension {dim} of shape {tuple(full.shape)} does not split {size} ways"
                         + (f" in each of {parts} parts" if packed else ""))
    if packed:
        each = full.unflatten(dim, (parts, -1))  # (.., parts, n/parts, ..)
        shard = each.shape[dim + 1] // size
        return each.narrow(dim + 1, rank * shard, shard).flatten(dim, dim + 1)
    shard = full.shape[dim] // size
    return full.narrow(dim, rank * shard, shard)


def tp_shard_parameter(full: torch.Tensor, split: tuple[int, int, int], requires_grad: bool = True) -> nn.Parameter:
    """A parameter holding this rank's slice of the whole tensor ``full`` for ``split`` (a copy, so
    ``full`` can be freed), tagged ``tp_split`` for the gathers and the gradient norm."""
    shard = nn.Parameter(tp_slice(full.detach(), split).clone(), requires_grad=requires_grad)
    shard.tp_split = split
    return shard


def _local_size(full: int, group: dist.ProcessGroup | None, what: str) -> int:
    size = group_size(group)
    if full % size:
        raise ValueError(f"{what}={full} is not divisible by the tensor-parallel size {size}")
    return full // size


# ---- layers

class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split across ranks: (..., in) -> (..., out/tp).

    ``gather_output=True`` all-gathers the output to (..., out). ``skip_bias_add=True`` returns
    ``(y_without_bias, bias_shard)`` so the caller can fuse the bias into its own epilogue (e.g.
    bias + GeLU); it cannot be combined with ``gather_output``. ``input_in_region=True``: the caller
    entered the TP region already (``copy_to_tp_region``, once for several layers that read the same
    input, whose gradients are then all-reduced once, summed). Init: N(0, init_std), bias zero.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, gather_output: bool = False,
                 skip_bias_add: bool = False, init_std: float = 0.02, seed: int = 0,
                 input_in_region: bool = False) -> None:
        super().__init__()
        if gather_output and skip_bias_add:
            raise ValueError("ColumnParallelLinear: skip_bias_add returns the bias shard, so the "
                             "output cannot also be gathered (gather_output=True)")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.skip_bias_add = group, gather_output, skip_bias_add
        self.input_in_region = input_in_region
        local_out = _local_size(out_features, group, "out_features")
        self.weight = mark_tp_split(nn.Parameter(torch.empty(local_out, in_features)), 0, group)
        self.bias = mark_tp_split(nn.Parameter(torch.zeros(local_out)), 0, group) if bias else None
        init_normal_(self.weight, init_std, seed, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_in_region:
            x = copy_to_tp_region(x, self.group)  # (..., in), gradient summed over ranks
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)  # (..., out/tp)
        if self.skip_bias_add:
            return y, self.bias
        return gather_from_tp_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split across ranks: (..., in/tp) -> (..., out).

    The input is this rank's slice (``input_is_parallel=True``, the output of a column-parallel
    layer) or is split here. Partial products are all-reduced; the bias (replicated) is added
    after the reduction, or returned with ``skip_bias_add=True``. Init: N(0, init_std), bias zero.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, init_std: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel, self.skip_bias_add = group, input_is_parallel, skip_bias_add
        local_in = _local_size(in_features, group, "in_features")
        self.weight = mark_tp_split(nn.Parameter(torch.empty(out_features, local_in)), 1, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        init_normal_(self.weight, init_std, seed, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)  # (..., in/tp)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)  # (..., out), summed
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary entries) are split across ranks: idx (...) -> (..., dim).

    Rank r holds ids [r * n/tp, (r+1) * n/tp); it looks up the ids it holds, writes zeros for the
    others, and the all-reduce sums the one non-zero contribution per token. Init: N(0, init_std).
    ``padding_idx`` (a global id, as ``nn.Embedding``'s): its row gets no gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 group: dist.ProcessGroup | None = None, init_std: float = 0.02, seed: int = 0,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        local = _local_size(num_embeddings, group, "num_embeddings")
        self.vocab_start = group_rank(group) * local
        self.vocab_end = self.vocab_start + local
        self.padding_idx = padding_idx
        held = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if held else None
        self.weight = mark_tp_split(nn.Parameter(torch.empty(local, embedding_dim)), 0, group)
        init_normal_(self.weight, init_std, seed, "weight")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.embedding(idx, self.weight, self._local_padding_idx)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)  # (...)
        local_idx = (idx - self.vocab_start).masked_fill(outside, 0)  # (...)
        # NOTE: an outside id looks up local row 0 and its output is zeroed, so row 0's gradient from
        # it is zero too: the padding row alone is kept out of the gradient, as nn.Embedding does
        out = F.embedding(local_idx, self.weight, self._local_padding_idx)  # (..., dim)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # ids held by other ranks
        return reduce_from_tp_region(out, self.group)  # (..., dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"local rows [{self.vocab_start}, {self.vocab_end})")
