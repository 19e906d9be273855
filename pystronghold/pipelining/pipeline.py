"""Pipeline parallelism: each stage runs the window runtime over its own blocks, on
``torch.distributed.pipelining`` (its schedules move activations; we write no scheduler).

``Pipeline`` runs one rank's stage(s) through ``wrap`` with a torch schedule (1F1B, GPipe or
interleaved with v model chunks per rank, one engine for all of them), all-reduces tied-embedding
gradients between the first and last stage, and ``step(x, y)`` is one optimizer step. The split
and schedule order come from ``planner.pipeline``; stage modules from ``pipelining.stages``. In
fp32 the summed micro-batch gradient is the global batch's mean, clipping uses the norm over all
stages, and an fp16 overflow anywhere skips the step on every rank.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.parallel.groups import ParallelGroups
from pystronghold.pipelining.stages import PipelineChunks, PipelineStageModule
from pystronghold.planner.pipeline import rank_passes, rank_stages, stage_passes
from pystronghold.runtime.api import wrap
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.streaming.schedule import pass_uses, plan_uses
from pystronghold.settings.parallel import ParallelOptions

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)

class Pipeline:
    """This rank's pipeline stage trained through the window runtime.

    ``stage``: this rank's ``PipelineStageModule``, or for ``schedule="interleaved"`` the list of its
    model chunks (one engine runs them). ``loss_fn(output, target)``: one micro-batch's mean loss;
    ``micro_batches``: m per step; ``hidden``, ``output_size``: sizes of the tensors between stages
    and of the last output; ``tied``: parameters whose gradients are summed over
    ``groups.embedding_group``. ``options`` are ``wrap``'s, or ``config=`` a ``RuntimeConfig``.
    """

    def __init__(self, stage: PipelineStageModule | Sequence[PipelineStageModule], groups: ParallelGroups, *,
                 loss_fn: Callable, micro_batches: int, hidden: int, output_size: int, schedule: str = "1f1b",
                 tied: Sequence[torch.Tensor] = (), config: RuntimeConfig | None = None, **options) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        if groups.pp_size < 2:
            raise ValueError(f"Pipeline needs init_parallel(..., pp=P) with P >= 2, got pp={groups.pp_size}")
        chunks = [stage] if isinstance(stage, nn.Module) else list(stage)
        # the one check of the pipeline settings, as ParallelOptions' fields (every chunk's module holds
        # a block at least; gpt_chunks checks the model's count); micro_batches=0: one per stage
        micro_batches = ParallelOptions(pp=groups.pp_size, micro_batches=micro_batches, pp_schedule=schedule,
                                        pp_chunks=len(chunks)).micro_batch_count
        if config is not None and options:
            raise TypeError(f"Pipeline: give config= or options ({', '.join(options)}), not both")
        config = config if config is not None else RuntimeConfig(**options)
        if config.accumulation_steps != 1:
            raise ValueError("Pipeline: accumulation_steps= is set by micro_batches= (the stage "
                             "accumulates the gradients of every micro-batch of a step)")
        if config.parallel not in (None, groups):
            raise ValueError("Pipeline: parallel= must be the groups given (or left out)")
        if config.layer_drop:
            raise ValueError("Pipeline: layer_drop= is not supported with a pipeline (every stage "
                             "would have to draw the same blocks)")
        self.groups, self.micro_batches, self.schedule_name = groups, micro_batches, schedule
        self.first, self.last = groups.pp_rank == 0, groups.pp_rank == groups.pp_size - 1
        # NOTE: a collective: after every local check, before anything can fail on one rank alone
        layout = _check_stage_order(chunks, groups)
        self.chunks = chunks
        """This rank's model chunks (one stage each in torch's schedule), chunk 0 first."""
        self.stage_module = chunks[0] if len(chunks) == 1 else PipelineChunks(chunks)
        """The module the engine wraps: the stage, or every chunk's blocks (``PipelineChunks``)."""
        self.user_loss_fn, self.tied = loss_fn, list(tied)
        self.hidden, self.output_size = hidden, output_size
        self.engine = wrap(self.stage_module, blocks=self.stage_module.blocks,
                           config=dataclasses.replace(config, accumulation_steps=micro_batches, parallel=groups))
        self.passes: list[tuple[int, str]] | None = None
        """The passes ``(chunk, "fwd" | "bwd")`` this rank runs in one training step, in order (for
        the interleaved schedule: known once its first step built torch's schedule)."""
        if schedule != "interleaved":  # (interleaved: from torch's action list, once it is built)
            self._use_passes([(0, kind) for kind in stage_passes(schedule, groups.pp_rank, groups.pp_size,
                                                                micro_batches)], train=True)
        self._stage_cls = PipelineStage
        # NOTE: torch 2.11's PipelineStage (the GPU machine's) takes no gradient shapes: it gives the
        # gradients their activations' shapes, which is what we pass where it does take them
        self._stage_takes_grad_shapes = "input_grads" in inspect.signature(PipelineStage).parameters
        self._schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                              "interleaved": ScheduleInterleaved1F1B}[schedule]
        self._schedules: dict[tuple, object] = {}  # by micro-batch input shape
        self._losses: list[torch.Tensor] = []
        self.stage_blocks = [[g for chunk in rank for g in chunk[0]] for rank in layout]
        """The global block indices each pipeline rank holds (all its chunks), rank 0 first."""
        self.block_indices = self.stage_blocks[groups.pp_rank]
        """The global index of each block of this rank, in the engine's (local) order."""

    def _use_passes(self, passes: list[tuple[int, str]], train: bool) -> None:
        """Plan the engine's window over a step's passes ``(chunk, kind)``: each pass uses the
        streamed blocks of its chunk (the first K blocks of the rank are resident: not planned)."""
        if train:
            self.passes = list(passes)
        engine = self.engine
        resident = engine.n_blocks - engine.n_streamed
        ranges = [range(max(r.start, resident) - resident, max(r.stop, resident) - resident)
                  for r in self.stage_module.chunk_ranges]
        uses = pass_uses([(kind, ranges[chunk]) for chunk, kind in passes])
        if uses:
            engine.use_step_plan(plan_uses(uses, min(engine.window_size, engine.n_streamed)), train)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.user_loss_fn(output, target)
        self._losses.append(loss.detach())
        scaler = self.engine.scaler
        scaled = loss * scaler.scale if scaler is not None else loss
        return scaled / self.micro_batches  # the summed gradient is the global batch's mean

    def _schedule_for(self, x: torch.Tensor):
        """A PipelineStage and schedule for micro-batches of ``x``'s shape (made once per shape,
        with the activation shapes given, so torch runs no shape inference through the stage)."""
        m = self.micro_batches
        if x.shape[0] % m:
            raise ValueError(f"Pipeline.step: the batch of {x.shape[0]} samples must be divisible by "
                             f"micro_batches={m}")
        key = tuple(x.shape)
        if key not in self._schedules:
            mb = (x.shape[0] // m, *x.shape[1:])
            act = torch.empty(*mb, self.hidden, dtype=self.engine.dtype, device="meta")
            p, rank, v = self.groups.pp_size, self.groups.pp_rank, len(self.chunks)
            stages = []
            for chunk, index in zip(self.chunks, rank_stages(rank, p, v)):  # v = 1: the stage itself
                first, last = index == 0, index == p * v - 1
                # NOTE: a received activation requires grad only when its meta says so (else no
                # gradient would flow back to the previous stage)
                inputs = (torch.empty(mb, dtype=x.dtype, device="meta") if first
                          else act.clone().requires_grad_(True))
                outputs = (torch.empty(*mb, self.output_size, dtype=self.engine.dtype, device="meta")
                           if last else act)
                grads = (dict(input_grads=None if first else act, output_grads=None if last else act)
                         if self._stage_takes_grad_shapes else {})
                stages.append(self._stage_cls(chunk, index, p * v, self.engine.device, input_args=inputs,
                                              output_args=outputs, group=self.groups.pp_group, **grads))
            schedule = self._schedule_cls(stages if v > 1 else stages[0], m, loss_fn=self._loss,
                                          scale_grads=False)
            if v > 1 and not self._schedules:  # the window follows torch's own order of this rank's passes
                passes = rank_passes(schedule.pipeline_order[rank], p)
                self._use_passes(passes, train=True)
                self._use_passes([pass_ for pass_ in passes if pass_[1] == "fwd"], train=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on this replica's batch: inputs ``x`` (B, T) and targets ``y`` (B, T),
        B divisible by ``micro_batches`` (every rank of the pipeline passes the same batch; the
        first stage reads ``x``, the last ``y``). Returns the batch's mean loss (on every stage)."""
        self._run(self._schedule_for(x).step, x, y)
        if self.tied and self.groups.embedding_group is not None:
            grads = [p.grad for p in self.tied if p.grad is not None]
            if len(grads) != len(self.tied):
                raise RuntimeError("Pipeline: a tied parameter got no gradient this step")
            for g in grads:  # the embedding's and the LM head's contributions: both sides get the sum
                dist.all_reduce(g, group=self.groups.embedding_group)
        self.engine.step()
        self.engine.zero_grad()
        return self._broadcast_loss()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean loss of a batch without gradients (forward passes only, through the window in eval
        mode: no dropout); the same value on every stage. Same arguments as ``step``."""
        schedule = self._schedule_for(x)
        self.engine.eval()
        try:
            self._run(schedule.eval, x, y)
        finally:
            self.engine.train()
        return self._broadcast_loss()

    def _run(self, run: Callable, x: torch.Tensor, y: torch.Tensor) -> None:
        """``run`` (a schedule's step or eval) with what this stage feeds it: the first stage the
        inputs, the last the targets, the others nothing (they receive activations)."""
        self._losses.clear()
        # NOTE: contiguous, as the stage's input meta is: torch 2.11 checks strides too, and a shifted
        # slice such as tokens[:, :-1] would fail that check
        if self.first:
            run(x.to(self.engine.device).contiguous())
        elif self.last:
            run(target=y.to(self.engine.device).contiguous())
        else:
            run()

    def _broadcast_loss(self) -> float:
        """The last stage's mean micro-batch loss, sent to every stage of this pipeline."""
        loss = torch.zeros(1, dtype=torch.float64)
        if self.last:
            loss[0] = float(torch.stack([l.double() for l in self._losses]).mean())
        if self.groups.pp_group is not None:
            if dist.get_backend(self.groups.pp_group) == "nccl":
                loss = loss.cuda()
            dist.broadcast(loss, src=self.groups.pp_ranks[-1], group=self.groups.pp_group)
        return float(loss[0])

    def global_name(self, name: str) -> str:
        """A parameter's name in the whole model from its name in this stage (``blocks.{i}.*`` gets
        the global block index; then the stage module's ``model_name``)."""
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            name = f"blocks.{self.block_indices[int(index)]}.{rest}"
        return self.chunks[0].model_name(name)

    def stage_of_block(self, block: int) -> int:
        """The pipeline rank (``pp_rank``) holding global block ``block``."""
        for stage, blocks in enumerate(self.stage_blocks):
            if block in blocks:
                return stage
        raise ValueError(f"block {block} is on no stage (stages hold {self.stage_blocks})")

    def share_from(self, stage: int, value):
        """``value`` of stage ``stage`` on every stage of this pipeline (a broadcast of a picklable
        object over the pp group; every stage calls it, ``value`` is ignored elsewhere)."""
        box = [value if self.groups.pp_rank == stage else None]
        dist.broadcast_object_list(box, src=self.groups.pp_ranks[stage], group=self.groups.pp_group)
        return box[0]

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 value of this stage's parameters by their name in the whole model (``global_name``)."""
        return {self.global_name(name): value for name, value in self.engine.master_parameters().items()}

    def close(self) -> None:
        """Stop the stage's engine (its worker threads)."""
        self.engine.close()


def _check_stage_order(chunks: Sequence[PipelineStageModule], groups: ParallelGroups) -> list[list[tuple]]:
    """Every rank's chunks as (global block indices, has head, has tail), gathered over the pp
    group; ValueError on every rank (the same gathered data) unless the virtual stages (stage s:
    chunk s // p of rank s % p) hold blocks in increasing model order, the head on stage 0 only and
    the tail on the last only. Stages in another order would pass activations to the wrong blocks:
    a model that trains, wrongly, without an error."""
    layout = [None] * groups.pp_size
    dist.all_gather_object(layout, [(c.block_indices, c.head is not None, c.tail is not None) for c in chunks],
                           group=groups.pp_group)
    p, v = groups.pp_size, len(chunks)
    if any(len(rank) != v for rank in layout):
        raise ValueError(f"Pipeline: every rank must give the same number of model chunks, got "
                         f"{[len(rank) for rank in layout]}")
    stages = [layout[s % p][s // p] for s in range(p * v)]
    order = [g for blocks, _, _ in stages for g in blocks]
    heads = [s for s, (_, head, _) in enumerate(stages) if head]
    tails = [s for s, (_, _, tail) in enumerate(stages) if tail]
    if order != sorted(set(order)) or heads not in ([], [0]) or tails not in ([], [p * v - 1]):
        raise ValueError(
            "Pipeline: the stages must hold the model in order: stage s (chunk s // pp of rank s % pp) "
            "the blocks after stage s-1's, the head on stage 0 and the tail on the last stage only; got "
            + "; ".join(f"stage {s}: {'head + ' if head else ''}blocks {blocks}{' + tail' if tail else ''}"
                        for s, (blocks, head, tail) in enumerate(stages)))
    return layout
