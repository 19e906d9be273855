"""The parallel layout as settings: ``ParallelOptions`` (tensor x data x pipeline parallelism, a
component of ``TrainConfig`` and of ``PlanRequest``), its check against the launch's processes
(``ParallelOptions.check_world``) and the pipeline settings' one check (``check_pipeline``), each
raising ConfigError naming the field. The pipeline's arithmetic is ``planner/pipeline.py``'s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pystronghold.options import ConfigError, option

__all__ = ["SCHEDULES", "ParallelOptions", "check_pipeline"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""Pipeline schedules, by their torch.distributed.pipelining class (Schedule1F1B, ScheduleGPipe,
ScheduleInterleaved1F1B: several model chunks per rank)."""


def _sizes_from_text(text: str, flag: str) -> tuple[int, ...]:
    """'3,1' -> (3, 1); ConfigError naming ``flag`` for anything but comma-separated integers."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated sample counts like 3,1, got {text!r}") from None


def _positive_int(value, minimum: int = 1) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


@dataclass(kw_only=True, slots=True)
class ParallelOptions:
    """Tensor, data and pipeline parallelism (launch with torchrun --nproc-per-node PP*TP*DP)."""

    tp: int = 1
    """Tensor-parallel ranks per model replica (attention heads, MLP columns and vocabulary split)."""
    dp: int = 0
    """Data-parallel replicas, each fed its slice of every batch; 0: the world size / (--tp x --pp)."""
    dp_split: tuple[int, ...] | None = option(None, parse=_sizes_from_text, metavar="B0,B1,...")
    """Samples of every batch each data-parallel replica takes, in DP-rank order, for unlike devices
    (Whale's hardware-aware split, as pystronghold plan --cluster prints it; sum: --batch); each
    replica's loss is weighted by its share so the gradient is the whole batch's. Default: equal
    slices. Not with --pp."""
    pp: int = option(1, help="Pipeline stages the blocks are split across (balanced by compute).")
    """Pipeline stages the blocks are split across (``pystronghold.pipelining``): contiguous block
    ranges balanced by compute (the embedding on the first stage, the LM head on the last), each
    stage with its own window, store and host optimizer. 1: no pipeline."""
    micro_batches: int = option(0, help="Micro-batches each replica's batch is cut into for the pipeline; 0: --pp.")
    """Micro-batches each replica's batch is cut into for the pipeline (m); their gradients are
    summed into one optimizer step. 0: --pp (the fewest the 1F1B schedule takes)."""
    pp_schedule: str = option("1f1b", choices=SCHEDULES, help=(
        "Pipeline schedule (torch's Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B)."))
    """Pipeline schedule, by its ``torch.distributed.pipelining`` class: "1f1b" (Schedule1F1B: at
    most p - s micro-batches in flight on stage s), "gpipe" (ScheduleGPipe: all m in flight) or
    "interleaved" (ScheduleInterleaved1F1B: --pp-chunks model chunks per rank, the bubble divided
    by their number; --micro-batches a multiple of --pp)."""
    pp_chunks: int = option(1, help="Model chunks per pipeline rank for --pp-schedule interleaved (>= 2).")
    """Model chunks (virtual stages) per pipeline rank with ``--pp-schedule interleaved``: the blocks
    are split into pp x chunks balanced chunks, rank r holding chunks r, r + pp, ...; one window
    runtime per rank runs all of them. 1 for the other schedules."""
    dist_timeout: float = 300.0
    """Seconds a collective waits for the other ranks before the run fails."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(self, "tp", f"must be >= 1, got {self.tp}")
        if self.dp < 0:
            raise ConfigError(self, "dp", f"must be >= 1 (or 0: world size / (`tp` x `pp`)), got {self.dp}")
        check_pipeline(self)
        if self.dp_split is not None:
            if not isinstance(self.dp_split, tuple) or not self.dp_split or any(
                    isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.dp_split):
                raise ConfigError(self, "dp_split", f"must be positive sample counts, got {self.dp_split!r}")
        if self.dp_split is not None and self.pp > 1:
            raise ConfigError(self, "dp_split", "is not supported with a pipeline (pp > 1): the stages cut "
                                                "every replica's batch into equal micro-batches")
        if not self.dist_timeout > 0:
            raise ConfigError(self, "dist_timeout", f"must be > 0, got {self.dist_timeout}")

    def check_world(self) -> None:
        """The one check that pp x tp x dp is the number of processes of the launch
        (``world_size``): ConfigError naming the sizes (and, in one process, the torchrun line to
        launch). Local arithmetic, the same on every rank, so every rank raises before any
        collective (nothing can hang)."""
        pp, tp, dp, world = self.pp, self.tp, self.dp_size, self.world_size
        if pp > 1:
            if pp * tp * dp != world:
                launch = (f"; launch with torchrun --nproc-per-node {pp * tp * dp} -m pystronghold train ..."
                          if world == 1 else "")
                raise ConfigError(self, "pp=", f"x `tp=` x {dp} data-parallel replicas = {pp * tp * dp} processes, "
                                  f"but there are {world}{launch}")
            return
        if world == 1 and tp * dp > 1:
            raise ConfigError(self, "tp=", f"x `dp={dp}` needs {tp * dp} processes; launch with "
                              f"torchrun --nproc-per-node {tp * dp} -m pystronghold train ...")
        if world % tp:
            raise ConfigError(self, "tp=", f"must divide the number of processes {world}")
        if tp * dp != world:
            raise ConfigError(self, "tp=", f"x `dp={dp}` = {tp * dp} processes, but there are {world}")

    @property
    def world_size(self) -> int:
        """Processes of the launch (torchrun's WORLD_SIZE; 1 without a launcher)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def dp_size(self) -> int:
        """--dp in effect (0 resolved against the world size)."""
        return self.dp or max(self.world_size // (self.tp * self.pp), 1)

    @property
    def micro_batch_count(self) -> int:
        """--micro-batches in effect (0 resolved to --pp)."""
        return self.micro_batches or self.pp

    @property
    def distributed(self) -> bool:
        """Whether this run needs torch.distributed (several processes or sizes above 1)."""
        return self.world_size > 1 or self.pp * self.tp * self.dp_size > 1


def check_pipeline(options: ParallelOptions, blocks: int | None = None) -> None:
    """The one check of the pipeline settings of ``options`` (pp, micro_batches, pp_schedule,
    pp_chunks), and with ``blocks`` (the model's) that every model chunk gets a block. Local
    arithmetic only, the same on every rank, so every rank raises before any collective.
    ConfigError naming the field (``--pp-chunks`` on the command line)."""
    pp, m, schedule, v = options.pp, options.micro_batches, options.pp_schedule, options.pp_chunks
    if not _positive_int(pp):
        raise ConfigError(options, "pp", f"must be an int >= 1, got {pp!r}")
    if not _positive_int(m, 0):
        raise ConfigError(options, "micro_batches", f"must be an int >= 1 (or 0: `pp`), got {m!r}")
    if schedule not in SCHEDULES:
        raise ConfigError(options, "pp_schedule", f"must be one of {SCHEDULES}, got {schedule!r}")
    if not _positive_int(v):
        raise ConfigError(options, "pp_chunks", f"must be an int >= 1, got {v!r}")
    if schedule == "interleaved" and v < 2:
        raise ConfigError(options, "pp_chunks=", "must be >= 2 with `pp_schedule=` (one model chunk per rank "
                                                 "is `pp_schedule='1f1b'`)")
    if schedule != "interleaved" and v != 1:
        raise ConfigError(options, "pp_chunks=", "needs `pp_schedule='interleaved'`")
    if v > 1 and pp < 2:
        raise ConfigError(options, "pp_chunks=", "needs a pipeline: `pp=` stages must be >= 2")
    if pp == 1:
        return
    if schedule == "1f1b" and options.micro_batch_count < pp:
        raise ConfigError(options, "micro_batches=", "must be at least `pp=` stages for the 1F1B schedule")
    if schedule == "interleaved" and options.micro_batch_count % pp:
        raise ConfigError(options, "micro_batches=", "must be a multiple of `pp=` stages for the interleaved schedule")
    if blocks is not None and pp * v > blocks:
        raise ConfigError(options, "pp=", f"stages are more than the model's {blocks} blocks (every stage needs "
                          "at least one block)" if v == 1 else f"stages x `pp_chunks=` = {pp * v} model chunks are "
                          f"more than the model's {blocks} blocks (every chunk needs at least one block)")
