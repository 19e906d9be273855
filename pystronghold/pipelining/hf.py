"""A Hugging Face causal LM's pipeline stages (``train --model hf:DIR --pp P``), run by
``pipelining.pipeline.Pipeline`` with either schedule, one window per stage.

Stage s holds blocks ``split[s]`` (``planner.pipeline.even_split``: transformers' blocks are alike),
the input embedding on the first stage, the final norm and LM head on the last. Each stage runs the
family's own base-model forward with its block stack narrowed to the stage's blocks, so every block
gets the causal mask, positions and rotary embeddings the unsplit model gives it (sliding-window
layers included); a later stage's received hidden states replace the input of its first block.
The last stage returns the final hidden states and its loss is the one-process loss
(``models.hf_loss.hidden_states_loss``, chunked as ``--loss-chunk`` says). Under ``--tp`` the model
was split first (``models.hf_tp.shard_hf_model``): each stage holds its TP rank's shards, and the last
stage's LM head a vocabulary shard whose logits go to the vocabulary-parallel cross-entropy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch
from torch import nn

from pystronghold.models.hf import LazyHFModel, block_stack
from pystronghold.models.hf_loss import causal_lm_of, hidden_states_loss, lm_head_of
from pystronghold.options import ConfigError
from pystronghold.parallel.groups import ParallelGroups
from pystronghold.pipelining.pipeline import Pipeline
from pystronghold.pipelining.stages import PipelineStageModule
from pystronghold.planner.pipeline import even_split, rank_stages
from pystronghold.settings.parallel import ParallelOptions, check_pipeline

__all__ = ["hf_chunks", "hf_pipeline"]

log = logging.getLogger(__name__)


class _HFTail(nn.Module):
    """The last stage's parameters outside the blocks and the embedding: the base model's final
    norm (whatever the family calls it, under its own name) and the LM head."""

    def __init__(self, norms: dict[str, nn.Module], lm_head: nn.Module) -> None:
        super().__init__()
        for name, module in norms.items():
            self.add_module(name, module)
        self.lm_head = lm_head


class HFStage(PipelineStageModule):
    """One stage of a Hugging Face causal LM: ``forward(x)`` runs the family's base model over this
    stage's blocks only. ``x`` is the token ids (B, T) on the first stage, else the previous
    stage's hidden states (B, T, C); the output is the hidden states (B, T, C) after the last
    block, normed on the last stage (the LM head runs in the loss)."""

    def __init__(self, base: nn.Module, stack_name: str, lm_head: nn.Module, blocks: Sequence[nn.Module], *,
                 first: bool, last: bool, first_block: int, materialize, names: dict[str, str],
                 materialize_thread_safe: bool = False) -> None:
        """``names``: the model's names of the block stack (``blocks``), the embedding (``head``) and
        each of the base's other children and ``lm_head`` (by their attribute names)."""
        embedding = base.get_input_embeddings()
        tail = None
        if last:
            skip = {id(embedding), id(getattr(base, stack_name))}
            norms = {name: child for name, child in base.named_children()
                     if id(child) not in skip and any(True for _ in child.parameters())}
            tail = _HFTail(norms, lm_head)
        super().__init__(embedding if first else None, blocks, tail, first_block=first_block,
                         materialize=materialize, materialize_thread_safe=materialize_thread_safe)
        self.first, self.last = first, last
        # a tuple is no submodule: the base's parameters outside this stage are not the stage's
        self._base = (base,)
        self._stack_name = stack_name
        self._names = names

    def model_name(self, name: str) -> str:
        """The name in the causal LM (as one process names it) of a stage parameter: ``blocks.{g}.*``
        under the model's block stack, the embedding, norm and LM head under their own names."""
        part, rest = name.split(".", 1)
        if part == "blocks":
            return f"{self._names['blocks']}.{rest}"
        if part == "head":
            return f"{self._names['head']}.{rest}"
        child, rest = rest.split(".", 1)
        return f"{self._names[child]}.{rest}"

    @contextlib.contextmanager
    def _narrowed(self, x: torch.Tensor):
        """The base model with this stage's blocks as its stack; on a later stage, ``x`` given to
        the first block as its hidden states; yields where the last block's output is recorded."""
        base = self._base[0]
        full = getattr(base, self._stack_name)
        handles, out = [], []

        def take_input(module, args, kwargs):
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        def record(module, args, kwargs, output):
            out.append(output[0] if isinstance(output, tuple) else output)

        if not self.first:
            handles.append(self.blocks[0].register_forward_pre_hook(take_input, with_kwargs=True))
        handles.append(self.blocks[-1].register_forward_hook(record, with_kwargs=True))
        setattr(base, self._stack_name, self.blocks)
        try:
            yield out
        finally:
            setattr(base, self._stack_name, full)
            for handle in handles:
                handle.remove()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self._base[0]
        with self._narrowed(x) as out:
            if self.first:
                final = base(input_ids=x, use_cache=False).last_hidden_state
            else:
                # NOTE: the base runs on a stand-in without a graph (its embedding scaling, if any,
                # applies to it); only the shape, mask and positions come from it
                final = base(inputs_embeds=x.detach(), use_cache=False).last_hidden_state
        return final if self.last else out[-1]


def hf_chunks(lazy: LazyHFModel, model: nn.Module, groups: ParallelGroups, *, chunks: int = 1,
              split: Sequence[range] | None = None) -> tuple[list[HFStage], list[torch.Tensor], object]:
    """This rank's ``chunks`` model chunks of the Hugging Face causal LM ``model`` (``lazy.model``,
    or PEFT's wrapper of it), its tied parameters (the embedding and a tied LM head, for
    ``Pipeline(tied=...)``) and the loss head (``models.hf_loss.lm_head_of``). ``split``: the block
    ranges of the pp * chunks virtual stages; default ``planner.pipeline.even_split``."""
    parts = lm_head_of(model)
    if parts is None:
        raise ConfigError(f"--pp: {lazy.spec.architecture} ({lazy.spec.model_type}) has no known LM-head "
                          "transform (models.hf_loss.HEAD_TRANSFORMS), which the last pipeline stage needs")
    base, _, _ = parts
    stack_name, stack = block_stack(base)
    embedding = base.get_input_embeddings()
    others = [name for name, child in base.named_children()
              if child is not embedding and child is not stack and any(True for _ in child.parameters())]
    # NOTE: a stage trains only what it holds; the base's one other part (its final norm) is the
    # last stage's. A second part (GPT-2's position table, BLOOM's embedding norm) may run before
    # the blocks, on the first stage, and would silently not train there: refused, not guessed.
    if stack is not lazy.blocks or "." in stack_name or len(others) > 1:
        raise ConfigError(f"--pp: {lazy.spec.architecture} is not supported with a pipeline yet: its base model "
                          f"holds {', '.join(others) or 'nothing'} besides the embedding and the block stack "
                          f"{stack_name} (one final norm beside them, the stack a direct child, is what --pp splits)")
    lm_head = causal_lm_of(model).get_output_embeddings()
    p, n, layers = groups.pp_size, groups.pp_size * chunks, len(lazy.blocks)
    split = even_split(layers, n) if split is None else list(split)
    if len(split) != n:
        raise ValueError(f"split has {len(split)} stages, the layout {n}")
    if groups.rank == 0:
        log.info("pipeline split over %d stages%s: %s", p, f" x {chunks} chunks" if chunks > 1 else "", "; ".join(
            f"{f'stage {s}' if chunks == 1 else f'rank {s % p} chunk {s // p}'}: {'embedding + ' if s == 0 else ''}"
            f"blocks {r.start}-{r.stop - 1}{' + norm, LM head' if s == n - 1 else ''}" for s, r in enumerate(split)))
    where = {id(module): name for name, module in model.named_modules()}
    names = {"blocks": where[id(stack)], "head": where[id(embedding)], "lm_head": where[id(lm_head)],
             **{child: where[id(module)] for child, module in base.named_children()}}
    mine = [HFStage(base, stack_name, lm_head, [lazy.blocks[i] for i in split[index]], first=index == 0,
                    last=index == n - 1, first_block=split[index].start, materialize=lazy.materialize, names=names)
            for index in rank_stages(groups.pp_rank, p, chunks)]
    tied: list[torch.Tensor] = []
    weight = embedding.weight
    if lm_head.weight is weight and weight.requires_grad and p > 1:  # (frozen: --freeze, LoRA)
        if groups.pp_rank == 0:
            tied = [weight]
        if groups.pp_rank == p - 1:
            # parallel.data.is_pipeline_copy / tied_source: saved and resumed as the embedding
            weight.pp_tied_copy = f"{names['head']}.weight"
            tied = [weight]
    return mine, tied, parts


def hf_pipeline(lazy: LazyHFModel, model: nn.Module, groups: ParallelGroups, *, micro_batches: int,
                loss_chunk_tokens: int, schedule: str = "1f1b", chunks: int = 1,
                split: Sequence[range] | None = None, **options) -> Pipeline:
    """``Pipeline`` of this rank's stage (or ``chunks`` interleaved model chunks) of a Hugging Face
    causal LM (``hf_chunks``), its loss ``models.hf_loss.hidden_states_loss`` with
    ``loss_chunk_tokens`` tokens per chunk (0: the full logits); ``options`` are ``wrap``'s (or
    ``config=`` a RuntimeConfig)."""
    check_pipeline(ParallelOptions(pp=groups.pp_size, micro_batches=micro_batches, pp_schedule=schedule,
                                   pp_chunks=chunks), len(lazy.blocks))
    stages, tied, (_, head, params) = hf_chunks(lazy, model, groups, chunks=chunks, split=split)
    hidden = lazy.model.get_input_embeddings().weight.shape[1]

    tp_group = groups.tp_group if groups.tp_size > 1 else None

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # under --tp the last stage's LM head holds a vocabulary shard (models.hf_tp): the
        # vocabulary-parallel cross-entropy, as one pipeline-free TP run computes it
        return hidden_states_loss(output, targets, head, params, loss_chunk_tokens, tp_group=tp_group)

    return Pipeline(stages, groups, loss_fn=loss, micro_batches=micro_batches, hidden=hidden,
                    output_size=hidden, schedule=schedule, tied=tied, **options)
