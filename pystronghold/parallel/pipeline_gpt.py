"""A GPT's pipeline stages: the block split, this rank's stage (or interleaved model chunks), its
loss and tied embeddings, and ``gpt_pipeline``, which runs them on ``parallel.pipeline.Pipeline``.

- ``gpt_stage_costs``: per-block, head and tail forward FLOPs (what the split balances).
- ``gpt_chunks`` / ``gpt_stage``: this rank's model chunks (virtual stages ``pp_rank + c * pp``,
  ``parallel.pipeline.rank_stages``) built from the GPT's own head, blocks and tail; the split is
  ``planner.balance.stage_ranges`` (logged by rank 0) or given.
- ``gpt_loss``: the last stage's loss on its logits shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.parallel.groups import ParallelGroups
from pystronghold.parallel.pipeline import Pipeline, check_chunk_count, rank_stages, validate_pipeline
from pystronghold.parallel.stages import PipelineStageModule, build_stage
from pystronghold.planner.balance import stage_ranges

__all__ = ["gpt_stage_costs", "gpt_stage", "gpt_chunks", "gpt_pipeline", "gpt_loss"]

log = logging.getLogger(__name__)


def gpt_stage_costs(config, seq: int) -> tuple[list[float], float, float]:
    """(per-block, head, tail) forward FLOPs per sample of a ``GPTConfig``: blocks by the planner's
    formula; the head's embedding lookup and add (2*T*C); the tail's LM head (2*T*C*V)."""
    from pystronghold.planner.cost import block_forward_flops

    block = block_forward_flops(config, 1, seq)
    head = 2.0 * seq * config.hidden
    tail = 2.0 * seq * config.hidden * config.padded_vocab_size / config.tp_size
    return [block] * config.layers, head, tail


def gpt_stage(model, groups: ParallelGroups, *, seq: int | None = None,
              split: Sequence[range] | None = None) -> tuple[PipelineStageModule, list[torch.Tensor]]:
    """This rank's stage of a ``GPT`` and its tied parameters (for ``Pipeline(tied=...)``).

    ``split``: the block ranges of the stages; default ``planner.balance.stage_ranges`` on ``gpt_stage_costs``
    (logged by rank 0). With tied embeddings the last stage's LM head weight is marked as the copy
    (counted once in the gradient norm)."""
    chunks, tied = gpt_chunks(model, groups, chunks=1, seq=seq, split=split)
    return chunks[0], tied


def gpt_chunks(model, groups: ParallelGroups, *, chunks: int, seq: int | None = None,
               split: Sequence[range] | None = None) -> tuple[list[PipelineStageModule], list[torch.Tensor]]:
    """This rank's ``chunks`` model chunks of a ``GPT`` (virtual stages ``pp_rank + c * pp`` of
    p * chunks, for the interleaved schedule; chunks=1: its one stage) and its tied parameters.

    ``split``: the block ranges of the p * chunks virtual stages in model order; default
    ``planner.balance.stage_ranges`` on ``gpt_stage_costs`` (logged by rank 0). The head goes to
    virtual stage 0 (rank 0), the LM head to the last (rank p - 1)."""
    config = model.config
    p = groups.pp_size
    n = p * chunks
    check_chunk_count(p, chunks, config.layers)
    if split is None:
        costs, head, tail = gpt_stage_costs(config, seq or config.seq_len)
        split = stage_ranges(costs, n, head_cost=head, tail_cost=tail)
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
    validate_pipeline(groups.pp_size, config.layers, micro_batches, schedule, chunks)
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
    from pystronghold.models.gpt import lm_loss

    return lambda logits, targets: lm_loss(logits, targets, config.vocab_size, tp_group)
