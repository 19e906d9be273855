"""The four conjugate region functions of tensor parallelism (Shoeybi et al. 2019, Megatron-LM).

In a TP region each rank holds the r-th of ``size`` equal slices of the last dimension.
``copy_to_tp_region`` (identity; backward all-reduce), ``reduce_from_tp_region`` (all-reduce;
backward identity), ``scatter_to_tp_region`` (keep this rank's slice; backward all-gather) and
``gather_from_tp_region`` (all-gather; backward keep the slice). With a group of one rank (or
``group=None``) every function returns its input unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pystronghold.parallel.groups import group_rank, group_size

__all__ = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
           "gather_from_tp_region", "all_reduce", "split_last_dim", "gather_last_dim"]


# ---- the collectives (out of place, so autograd keeps the inputs it saved)

def all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group``, as a new tensor."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of the last dimension (..., N) -> (..., N / size), contiguous."""
    size = group_size(group)
    if size == 1:
        return x
    if x.size(-1) % size:
        raise ValueError(f"last dimension {x.size(-1)} does not split into {size} equal chunks")
    return x.chunk(size, dim=-1)[group_rank(group)].contiguous()


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension: (..., n) -> (..., n * size)."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


# ---- autograd functions

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region with a replicated input: identity forward, all-reduced gradient."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by summing partial results: all-reduce forward, identity gradient."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Enter a TP region by keeping this rank's slice of the last dim; gradient all-gathered."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Leave a TP region by all-gathering the last dim; gradient split back to this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group)
