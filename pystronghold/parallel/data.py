"""Data-parallel gradient averaging and the cross-rank agreements of an optimizer step.

Every collective the window runtime issues goes through here: ``average_`` (one block's flat
gradient buffer, in place, one all_reduce per block), ``average_grads_`` (head and tail
gradients, one bucket per dtype), ``global_grad_norm`` (the whole model's L2 norm from
per-parameter norms, TP-replicated parameters counted once) and ``any_rank`` (a flag such as an
fp16 overflow, agreed by all ranks). With one rank each is local and issues no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pystronghold.parallel.groups import group_rank, group_size

__all__ = ["average_", "average_grads_", "is_tp_shard", "is_pipeline_copy", "tied_source", "global_grad_norm", "any_rank"]


def average_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Replace ``flat`` by its mean over the ranks of ``group`` (sum all_reduce, then divide by the
    group size). Returns ``flat``. A collective: every rank of ``group`` must call it, in the same
    order, with a tensor of the same numel and dtype."""
    n = group_size(group)
    if n > 1:
        dist.all_reduce(flat, group=group)
        flat.div_(n)
    return flat


@torch.no_grad()
def average_grads_(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Average the ``.grad`` of ``params`` across ``group``: one all_reduce per gradient dtype.

    Parameters whose ``.grad`` is None are skipped; every rank must have gradients for the same
    parameters (the bucket layouts must agree).
    """
    if group_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        grads = by_dtype[dtype]
        bucket = average_(torch.cat([g.reshape(-1) for g in grads]), group)  # (sum of numels,)
        offset = 0
        for g in grads:
            g.copy_(bucket[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def is_tp_shard(param: torch.Tensor) -> bool:
    """True for a parameter split across tensor-parallel ranks (``tp_split`` over more than one)."""
    return getattr(param, "tp_split", (0, 0, 1))[2] > 1


def is_pipeline_copy(param: torch.Tensor) -> bool:
    """True for the last pipeline stage's copy of a weight tied to the first stage's (the LM head
    tied to the embedding): its gradient is all-reduced with the original, so it counts once."""
    return bool(getattr(param, "pp_tied_copy", None))


def tied_source(param: torch.Tensor) -> str | None:
    """The model name of the weight a pipeline copy is tied to (its checkpoint key), else None."""
    return getattr(param, "pp_tied_copy", None) or None


def global_grad_norm(norms: list[torch.Tensor], sharded: list[bool],
                     tp_group: dist.ProcessGroup | None,
                     pp_group: dist.ProcessGroup | None = None) -> float:
    """The L2 norm of the whole model's gradient, from per-parameter L2 norms (fp32 scalars).

    Without tensor parallelism ``vector_norm(stack(norms))``, as ``clip_grad_norm_``. With it,
    squares of sharded norms (``sharded[i]``) are summed over the TP group and replicated parameters
    counted once; with ``pp_group`` the squares are summed over the stages too (float64), so every
    rank clips with the same norm. DP ranks need no reduction (their gradients are already averaged).
    """
    if group_size(pp_group) > 1:
        own = torch.zeros((), dtype=torch.float64)
        if norms:
            own = torch.tensor(global_grad_norm(norms, sharded, tp_group), dtype=torch.float64) ** 2
        total = own.reshape(1)
        if dist.get_backend(pp_group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=pp_group)
        return float(total.sqrt())
    if not norms:
        return 0.0
    stacked = torch.stack([n.detach().float().cpu() for n in norms])  # (P,)
    if group_size(tp_group) == 1:
        return float(torch.linalg.vector_norm(stacked))
    mask = torch.tensor(sharded, dtype=torch.bool)
    squares = stacked.double().square()
    total = squares[mask].sum()
    if group_rank(tp_group) == 0:
        total = total + squares[~mask].sum()
    total = total.reshape(1)
    if dist.get_backend(tp_group) == "nccl":
        total = total.cuda()
    dist.all_reduce(total, group=tp_group)
    return float(total.sqrt())


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank of the torch.distributed world (a collective when the
    world has more than one process; else ``flag`` itself)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
