"""A Hugging Face causal LM's pipeline stages (``train --model hf:DIR --pp P``), run by
``pipelining.pipeline.Pipeline`` with either schedule, one window per stage.

Stage s holds blocks ``split[s]`` (``planner.pipeline.even_split``: transformers' blocks are alike),
the first stage the input embedding and the base's parts that run before the blocks (a position
table, an embedding norm, an input projection), the last the parts after them (the final norm, an
output projection) and the LM head: ``BASE_PARTS`` places each by its name. Each stage runs the
family's own base-model forward with its block stack narrowed to the stage's blocks, so every block
gets the causal mask, positions, rotary embeddings and ALiBi biases the unsplit model gives it
(sliding-window layers included); a later stage's received hidden states replace the input of its
first block, and a part the stage does not hold is stood in for by a no-op (``_narrowed``), so a
stage trains exactly what it holds. The last stage returns the final hidden states and its loss is
the one-process loss (``models.hf_loss.hidden_states_loss``, chunked as ``--loss-chunk`` says).
Under ``--tp`` the model was split first (``models.hf_tp.shard_hf_model``): each stage holds its TP
rank's shards, and the last stage's LM head a vocabulary shard whose logits go to the
vocabulary-parallel cross-entropy.
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

__all__ = ["BASE_PARTS", "hf_chunks", "hf_pipeline"]

log = logging.getLogger(__name__)


BASE_PARTS = {
    "wpe": ("first", "position table"),  # GPT-2, GPT-BigCode: added to the token embeddings
    "embed_positions": ("first", "position table"),  # OPT: added to the (projected) token embeddings
    "word_embeddings_layernorm": ("first", "embedding norm"),  # BLOOM
    "project_in": ("first", "input projection"),  # OPT with word_embed_proj_dim != hidden_size
    **{name: ("last", "norm") for name in ("norm", "ln_f", "final_layer_norm", "final_layernorm")},
    "project_out": ("last", "output projection"),  # OPT with word_embed_proj_dim != hidden_size
}
"""Name -> (stage, what it is) of each part with parameters that a Hugging Face base model holds
beside its input embedding and block stack, as transformers names it in the families
``models.hf_loss.HEAD_TRANSFORMS`` knows (the only ones ``--pp`` runs): read off each family's
base-model forward, which runs it before the blocks (the first stage holds it) or after them (the
last). A part named otherwise is refused, never guessed: a stage that ran it without holding it
would not train it. Parts without parameters (dropout, rotary tables) run on every stage."""


class _HFParts(nn.Module):
    """The parameters a first or last stage holds outside the blocks: the embedding (``embedding``)
    or the LM head (``lm_head``), and the base model's parts under their attribute names."""

    def __init__(self, parts: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)


class _NoPositions(nn.Module):
    """Stands in for a position table on a stage that does not hold it: a 0-dim zero, added to the
    hidden states without changing their dtype (the stage's own input replaces them anyway)."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.zeros(())


def _base_parts(base: nn.Module, stack_name: str, embedding: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(owner, attribute, module)`` of each part with parameters on the way from ``base`` to its
    block stack (``base`` itself, OPT's ``decoder``), other than the stack, the modules on that way
    and ``embedding``."""
    owners = [base]
    for name in stack_name.split(".")[:-1]:
        owners.append(getattr(owners[-1], name))
    skip = {id(m) for m in owners} | {id(base.get_submodule(stack_name)), id(embedding)}
    return [(owner, name, child) for owner in owners for name, child in owner.named_children()
            if id(child) not in skip and any(True for _ in child.parameters())]


class HFStage(PipelineStageModule):
    """One stage of a Hugging Face causal LM: ``forward(x)`` runs the family's base model over this
    stage's blocks only. ``x`` is the token ids (B, T) on the first stage, else the previous
    stage's hidden states (B, T, C); the output is the hidden states (B, T, C) after the last
    block, normed (and projected to the LM head's width: OPT's project_out) on the last stage (the
    LM head runs in the loss)."""

    def __init__(self, base: nn.Module, stack_name: str, lm_head: nn.Module, blocks: Sequence[nn.Module], *,
                 first: bool, last: bool, first_block: int, materialize, names: dict[str, str],
                 parts: Sequence[tuple[nn.Module, str, nn.Module]] = (), materialize_thread_safe: bool = False) -> None:
        """``names``: the model's names of the block stack (``blocks``), the embedding (``embedding``),
        the LM head (``lm_head``) and each of ``parts`` (by its attribute name). ``parts``: the base's
        parts beside the embedding and the stack, ``(owner, attribute, module)``, each named in
        ``BASE_PARTS``."""
        embedding = base.get_input_embeddings()
        sides = {side for side, mine in (("first", first), ("last", last)) if mine}
        held = [part for part in parts if BASE_PARTS[part[1]][0] in sides]
        head = tail = None
        if first:
            head = _HFParts({"embedding": embedding, **{name: module for _, name, module in held}})
        if last:
            tail = _HFParts({**{name: module for _, name, module in held}, "lm_head": lm_head})
        super().__init__(head, blocks, tail, first_block=first_block, materialize=materialize,
                         materialize_thread_safe=materialize_thread_safe)
        self.first, self.last = first, last
        # a tuple is no submodule: the base's parameters outside this stage are not the stage's
        self._base = (base,)
        self._stack_name = stack_name
        self._names = names
        self._not_held = tuple((owner, name) for owner, name, _ in parts if BASE_PARTS[name][0] not in sides)

    def model_name(self, name: str) -> str:
        """The name in the causal LM (as one process names it) of a stage parameter: ``blocks.{g}.*``
        under the model's block stack, the embedding, the base's parts and the LM head under their own
        names."""
        part, rest = name.split(".", 1)
        if part == "blocks":
            return f"{self._names['blocks']}.{rest}"
        child, rest = rest.split(".", 1)
        return f"{self._names[child]}.{rest}"

    @contextlib.contextmanager
    def _narrowed(self, x: torch.Tensor):
        """The base model with this stage's blocks as its stack and a no-op for each part it does not
        hold (the first stage's output is its last block's; a later stage's input replaces its first
        block's); on a later stage, ``x`` given to the first block as its hidden states; yields where
        the last block's output is recorded."""
        base = self._base[0]
        owner_name, _, stack_attr = self._stack_name.rpartition(".")
        owner = base.get_submodule(owner_name)
        swapped = [(owner, stack_attr, self.blocks)]
        for part_owner, name in self._not_held:
            stand_in = _NoPositions() if BASE_PARTS[name][1] == "position table" else nn.Identity()
            swapped.append((part_owner, name, stand_in))
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
        kept = [(where, name, getattr(where, name)) for where, name, _ in swapped]
        for where, name, module in swapped:
            setattr(where, name, module)
        try:
            yield out
        finally:
            for where, name, module in kept:
                setattr(where, name, module)
            for handle in handles:
                handle.remove()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self._base[0]
        with self._narrowed(x) as out:
            if self.first:
                final = base(input_ids=x, use_cache=False).last_hidden_state
            else:
                # NOTE: the base runs on a stand-in without a graph (its embedding scaling, if any,
                # applies to it; the parts before the blocks are no-ops here); only the shape, dtype,
                # mask, positions and ALiBi biases come from it
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
    p, n, layers = groups.pp_size, groups.pp_size * chunks, len(lazy.blocks)
    placed = _base_parts(base, stack_name, embedding)
    unknown = [name for _, name, _ in placed if name not in BASE_PARTS]
    if stack is not lazy.blocks or unknown:
        raise ConfigError(ParallelOptions(pp=p), "pp",
                          f": {lazy.spec.architecture} is not supported with a pipeline yet: its base model holds "
                          f"{', '.join(unknown) or 'another block stack'} besides the embedding and the block stack "
                          f"{stack_name}, and where it runs (before or after the blocks) is not known here "
                          "(pipelining.hf.BASE_PARTS)")
    lm_head = causal_lm_of(model).get_output_embeddings()
    split = even_split(layers, n) if split is None else list(split)
    if len(split) != n:
        raise ValueError(f"split has {len(split)} stages, the layout {n}")
    if groups.rank == 0:
        def labels(side: str) -> list[str]:  # in the order of BASE_PARTS, which is the forward's
            held = {name for _, name, _ in placed}
            return list(dict.fromkeys(label for name, (where, label) in BASE_PARTS.items()
                                      if where == side and name in held))

        first, last = ", ".join(["embedding", *labels("first")]), ", ".join([*labels("last"), "LM head"])
        log.info("pipeline split over %d stages%s: %s", p, f" x {chunks} chunks" if chunks > 1 else "", "; ".join(
            f"{f'stage {s}' if chunks == 1 else f'rank {s % p} chunk {s // p}'}: {first + ' + ' if s == 0 else ''}"
            f"blocks {r.start}-{r.stop - 1}{' + ' + last if s == n - 1 else ''}" for s, r in enumerate(split)))
    where = {id(module): name for name, module in model.named_modules()}
    names = {"blocks": where[id(stack)], "embedding": where[id(embedding)], "lm_head": where[id(lm_head)],
             **{name: where[id(module)] for _, name, module in placed}}
    mine = [HFStage(base, stack_name, lm_head, [lazy.blocks[i] for i in split[index]], first=index == 0,
                    last=index == n - 1, first_block=split[index].start, materialize=lazy.materialize, names=names,
                    parts=placed)
            for index in rank_stages(groups.pp_rank, p, chunks)]
    tied: list[torch.Tensor] = []
    weight = embedding.weight
    if lm_head.weight is weight and weight.requires_grad and p > 1:  # (frozen: --freeze, LoRA)
        if groups.pp_rank == 0:
            tied = [weight]
        if groups.pp_rank == p - 1:
            # parallel.data.is_pipeline_copy / tied_source: saved and resumed as the embedding
            weight.pp_tied_copy = f"{names['embedding']}.weight"
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
    # between the stages: the blocks' width; out of the last: the LM head's input (an output projection's)
    hidden, output_size = lazy.model.config.hidden_size, causal_lm_of(model).get_output_embeddings().weight.shape[1]

    tp_group = groups.tp_group if groups.tp_size > 1 else None

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # under --tp the last stage's LM head holds a vocabulary shard (models.hf_tp): the
        # vocabulary-parallel cross-entropy, as one pipeline-free TP run computes it
        return hidden_states_loss(output, targets, head, params, loss_chunk_tokens, tp_group=tp_group)

    return Pipeline(stages, groups, loss_fn=loss, micro_batches=micro_batches, hidden=hidden,
                    output_size=output_size, schedule=schedule, tied=tied, **options)
