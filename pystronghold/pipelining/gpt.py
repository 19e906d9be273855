"""A GPT's pipeline stages: the block split, this rank's stage (or interleaved model chunks), its
loss and tied embeddings, and ``gpt_pipeline``, which runs them on ``pipelining.pipeline.Pipeline``.

- ``gpt_chunks`` / ``gpt_stage``: this rank's model chunks (virtual stages ``pp_rank + c * pp``,
  ``planner.pipeline.rank_stages``) built from the GPT's own head, blocks and tail; the split is
  ``planner.pipeline.stage_split`` (logged by rank 0) or given.
- ``gpt_loss``: the last stage's loss on its logits shard.
- ``gpt_pipeline_of``: the stages Whale's ``stage()`` scopes chose (``strategy.layout``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.models.gpt import lm_loss
from pystronghold.parallel.groups import ParallelGroups
from pystronghold.pipelining.pipeline import Pipeline
from pystronghold.pipelining.stages import PipelineStageModule, build_stage
from pystronghold.planner.pipeline import rank_stages, stage_split
from pystronghold.settings.parallel import ParallelOptions, check_pipeline
from pystronghold.strategy.layout import Layout

__all__ = ["gpt_stage", "gpt_chunks", "gpt_pipeline", "gpt_loss", "gpt_pipeline_of"]

log = logging.getLogger(__name__)


def gpt_stage(model, groups: ParallelGroups, *, seq: int | None = None,
              split: Sequence[range] | None = None) -> tuple[PipelineStageModule, list[torch.Tensor]]:
    """This rank's stage of a ``GPT`` and its tied parameters (for ``Pipeline(tied=...)``).

    ``split``: the block ranges of the stages; default ``planner.pipeline.stage_split``
    (logged by rank 0). With tied embeddings the last stage's LM head weight is marked as the copy
    (counted once in the gradient norm)."""
    chunks, tied = gpt_chunks(model, groups, chunks=1, seq=seq, split=split)
    return chunks[0], tied


def gpt_chunks(model, groups: ParallelGroups, *, chunks: int, seq: int | None = None,
               split: Sequence[range] | None = None) -> tuple[list[PipelineStageModule], list[torch.Tensor]]:
    """This rank's ``chunks`` model chunks of a ``GPT`` (virtual stages ``pp_rank + c * pp`` of
    p * chunks, for the interleaved schedule; chunks=1: its one stage) and its tied parameters.

    ``split``: the block ranges of the p * chunks virtual stages in model order; default
    ``planner.pipeline.stage_split`` (logged by rank 0). The head goes to
    virtual stage 0 (rank 0), the LM head to the last (rank p - 1)."""
    config = model.config
    p = groups.pp_size
    n = p * chunks
    if split is None:
        split, costs, head, tail = stage_split(config, seq or config.seq_len, n)
        if groups.rank == 0:
            total = sum(costs) + head + tail
            log.info("pipeline split over %d stages%s: %s", p, f" x {chunks} chunks" if chunks > 1 else "", "; ".join(
                f"{f'stage {s}' if chunks == 1 else f'rank {s % p} chunk {s // p}'}: {'head + ' if s == 0 else ''}"
                f"blocks {r.start}-{r.stop - 1}{' + LM head' if s == n - 1 else ''} "
                f"({100 * (sum(costs[r.start:r.stop]) + (head if s == 0 else 0) + (tail if s == n - 1 else 0)) / total:.1f}% of the FLOPs)"
                for s, r in enumerate(split)))
    if len(split) != n:
        raise ValueError(f"split has {len(split)} stages, the layout pp={p}"
                         + (f" x chunks={chunks} = {n}" if chunks > 1 else ""))
    starts = [0] + [r.stop for r in split[:-1]]
    if any(r.step != 1 or r.start != a or len(r) < 1 for r, a in zip(split, starts)) or split[-1].stop != config.layers:
        raise ValueError(f"split must be contiguous non-empty ranges covering blocks 0..{config.layers - 1} "
                         f"in order, got {list(split)}")
    mine = []
    for index in rank_stages(groups.pp_rank, p, chunks):
        blocks = split[index]
        mine.append(build_stage(model.head if index == 0 else None, [model.blocks[i] for i in blocks],
                                _LogitsTail(model.tail) if index == n - 1 else None, first_block=blocks.start,
                                materialize=model.materialize_block_,
                                materialize_thread_safe=getattr(model, "materialize_block_thread_safe", False)))
    first, last = groups.pp_rank == 0, groups.pp_rank == p - 1
    tied: list[torch.Tensor] = []
    if config.tie_embeddings and p > 1:
        if first:
            tied = [model.head.tok.weight]
        if last:
            weight = model.tail.lm_head.weight
            weight.pp_tied_copy = "head.tok.weight"  # parallel.data.is_pipeline_copy / tied_source
            tied = [weight]
    return mine, tied


def gpt_pipeline(model, groups: ParallelGroups, *, micro_batches: int, schedule: str = "1f1b", chunks: int = 1,
                 seq: int | None = None, split: Sequence[range] | None = None, **options) -> Pipeline:
    """``Pipeline`` of this rank's stage of a ``GPT`` (``gpt_chunks``: ``split`` given, or balanced;
    ``chunks`` model chunks per rank with ``schedule="interleaved"``), with its loss and tied
    embeddings; ``options`` are ``wrap``'s (or ``config=`` a RuntimeConfig)."""
    config = model.config
    if options.pop("parallel", groups) is not groups:
        raise ValueError("gpt_pipeline: parallel= must be the groups given (or left out)")
    check_pipeline(ParallelOptions(pp=groups.pp_size, micro_batches=micro_batches, pp_schedule=schedule,
                                   pp_chunks=chunks), config.layers)
    stages, tied = gpt_chunks(model, groups, chunks=chunks, seq=seq, split=split)
    return Pipeline(stages, groups, loss_fn=gpt_loss(config, groups.tp_group), micro_batches=micro_batches,
                    hidden=config.hidden, output_size=config.padded_vocab_size // config.tp_size,
                    schedule=schedule, tied=tied, **options)


class _LogitsTail(nn.Module):
    """A GPT tail that returns this TP rank's logits shard (B, T, V_padded / tp) for the loss."""

    def __init__(self, tail: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = tail.ln_f, tail.lm_head  # the GPT's parameter names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V_padded / tp)


def gpt_loss(config, tp_group: dist.ProcessGroup | None) -> Callable:
    """The loss function of a GPT's last stage: ``models.gpt.lm_loss`` of its logits shard."""
    return lambda logits, targets: lm_loss(logits, targets, config.vocab_size, tp_group)


def gpt_pipeline_of(model: nn.Module, layout: Layout, groups: ParallelGroups, *, schedule: str = "1f1b",
                    seq: int | None = None, **options):
    """This rank's ``Pipeline`` of a ``GPT`` whose stages the scopes chose: ``gpt_pipeline`` with
    ``split=layout.block_ranges(model, model.blocks)`` and ``micro_batches=layout.num_micro_batch``;
    ``options`` are ``wrap``'s. ValueError when the layout is no pipeline of this model or
    ``groups`` were not made for it (``init_layout``)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"gpt_pipeline_of: expected a Layout, got {type(layout).__name__}")
    if layout.pp_size < 2:
        raise ValueError("gpt_pipeline_of: the layout has one stage; wrap the model with "
                         "pystronghold.wrap (or give it stage() scopes)")
    if groups.pp_size != layout.pp_size:
        raise ValueError(f"gpt_pipeline_of: the groups have pp={groups.pp_size}, the layout "
                         f"{layout.pp_size} stages (make them with init_layout(layout))")
    return gpt_pipeline(model, groups, micro_batches=layout.num_micro_batch, schedule=schedule, seq=seq,
                        split=layout.block_ranges(model, model.blocks), **options)
