"""Tensor-parallel (TP), data-parallel (DP) and pipeline (PP) process groups over the world.

As Megatron-LM: with world = pp * dp * tp, global rank r is TP rank ``r % tp`` of replica
``(r // tp) % dp`` in stage ``r // (tp * dp)`` (TP adjacent, within a node; stages outermost).
Embedding groups join each pipeline's first and last rank (tied embeddings, pp > 1). Sizes are
checked identically on every rank before any group is made, so a bad layout raises the same
ValueError everywhere and no rank hangs.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ParallelGroups", "init_parallel", "validate_parallel_sizes", "group_size", "group_rank", "free_local_port"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParallelGroups:
    """This rank's place in the TP x DP grid. Groups are None in a single-process run."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes (tp_size * dp_size)."""
    tp_size: int
    """Ranks that split one model replica (heads, MLP columns, vocabulary)."""
    dp_size: int
    """Model replicas, each fed a different slice of the batch."""
    tp_rank: int
    """This rank's index in its TP group."""
    dp_rank: int
    """This rank's index in its DP group (which replica it is)."""
    tp_group: dist.ProcessGroup | None
    """The TP group of this rank (None when tp_size == 1 and the world has one process)."""
    dp_group: dist.ProcessGroup | None
    """The DP group of this rank (None when the world has one process)."""
    pp_size: int = 1
    """Pipeline stages the blocks are split across."""
    pp_rank: int = 0
    """This rank's stage."""
    pp_group: dist.ProcessGroup | None = None
    """The ranks holding the stages of this rank's replica and TP shard (None when pp_size == 1)."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last stage of this pipeline, for tied embeddings (None unless pp_size > 1 and
    this rank is the first or the last stage)."""
    pp_ranks: tuple[int, ...] = ()
    """Global ranks of this pipeline's stages, stage 0 first (empty when pp_size == 1)."""


def validate_parallel_sizes(world_size: int, tp_size: int, dp_size: int | None = None,
                            heads: int | None = None, pp_size: int = 1) -> int:
    """Check a PP x TP x DP layout and return the DP size (world_size // (tp_size * pp_size) when
    dp_size is None).

    Raises ValueError naming the size that does not fit: a size below 1, a world size not divisible
    by tp_size * pp_size, pp_size * tp_size * dp_size != world_size, heads not divisible by tp_size.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")
    if world_size % (tp_size * pp_size):
        what = f"tp_size={tp_size}" if pp_size == 1 else f"pp_size={pp_size} x tp_size={tp_size}"
        raise ValueError(f"{what} must divide the world size {world_size}")
    if dp_size is None:
        dp_size = world_size // (tp_size * pp_size)
    if not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive int, got {dp_size!r}")
    if pp_size * tp_size * dp_size != world_size:
        pp = f"pp_size={pp_size} x " if pp_size > 1 else ""
        raise ValueError(f"{pp}tp_size={tp_size} x dp_size={dp_size} = {pp_size * tp_size * dp_size} "
                         f"processes, but the world size is {world_size}")
    if heads is not None and heads % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide the number of attention heads {heads}")
    return dp_size


def init_parallel(tp_size: int = 1, dp_size: int | None = None, *, pp: int = 1, heads: int | None = None,
                  backend: str | None = None, timeout_s: float = 600.0) -> ParallelGroups:
    """Make the TP, DP (and, with ``pp`` > 1, pipeline) groups, initialising torch.distributed first
    when needed.

    Without a default process group but with ``WORLD_SIZE`` set (torchrun), the sizes (and ``heads``
    divisibility by ``tp_size``) are checked on every rank first, then the group is created with
    ``backend`` (default nccl with CUDA, else gloo); otherwise the run is one process. ``timeout_s``
    (seconds) is the collective timeout of the groups made here: a rank whose peers died raises.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    create = not dist.is_initialized() and "WORLD_SIZE" in os.environ
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    elif create:  # the world init_process_group would join (env://, as torchrun sets it)
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    else:
        world, rank = 1, 0
    # NOTE: checked before the default group is created: creating it is itself collective (the
    # store's rendezvous, gloo's full mesh), so a rank that raised after it would tear down its
    # sockets while a slower peer is still connecting, and that peer would fail with a connection
    # error instead of this ValueError.
    try:
        dp_size = validate_parallel_sizes(world, tp_size, dp_size, heads, pp_size=pp)
    except ValueError as err:
        if rank == 0:
            log.error("bad parallel configuration: %s", err)
        raise
    if create:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, timeout=timeout)
        world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return ParallelGroups(rank=0, world_size=1, tp_size=1, dp_size=1, tp_rank=0, dp_rank=0,
                              tp_group=None, dp_group=None)
    # NOTE: every rank must create every group, in the same order (torch.distributed.new_group).
    # A new group does not inherit the default group's timeout (it gets torch's 30 min): pass it.
    tp_group = dp_group = pp_group = embedding_group = None
    stage_size = tp_size * dp_size  # ranks per pipeline stage
    for stage in range(pp):
        for replica in range(dp_size):
            ranks = list(range(stage * stage_size + replica * tp_size, stage * stage_size + (replica + 1) * tp_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                tp_group = group
    for stage in range(pp):
        for tp_index in range(tp_size):
            ranks = list(range(stage * stage_size + tp_index, (stage + 1) * stage_size, tp_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                dp_group = group
    pp_ranks: tuple[int, ...] = ()
    if pp > 1:
        for first in range(stage_size):
            ranks = list(range(first, world, stage_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                pp_group, pp_ranks = group, tuple(ranks)
        for first in range(stage_size):
            ends = [first, first + (pp - 1) * stage_size]
            group = dist.new_group(ends, timeout=timeout)
            if rank in ends:
                embedding_group = group
    within = rank % stage_size
    groups = ParallelGroups(rank=rank, world_size=world, tp_size=tp_size, dp_size=dp_size,
                            tp_rank=within % tp_size, dp_rank=within // tp_size,
                            tp_group=tp_group, dp_group=dp_group, pp_size=pp, pp_rank=rank // stage_size,
                            pp_group=pp_group, embedding_group=embedding_group, pp_ranks=pp_ranks)
    if rank == 0:
        log.info("parallel layout: world %d = pp %d x tp %d x dp %d", world, pp, tp_size, dp_size)
    return groups


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for None (no parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def free_local_port() -> int:
    """A TCP port of 127.0.0.1 that is free now: the MASTER_PORT for ranks started on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
