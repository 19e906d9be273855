"""What a train run is built of, from its ``Run``: the model (our GPT, or a Hugging Face model read
lazily from its shards, with its MLP tiles, LoRA adapters and frozen parameters) and the engine
that trains it (``runtime.wrap``, or this rank's pipeline stage under --pp)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from torch import nn

from pystronghold.models import GPT
from pystronghold.models.freeze import freeze_matching
from pystronghold.models.hf_tiling import tile_mlps
from pystronghold.runtime.api import wrap
from pystronghold.settings.finetune import LoraSpec

__all__ = ["ModelParts", "load_hf_model", "build_model", "build_engine"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ModelParts:
    """A model built for the window runtime, before it is wrapped."""

    model: nn.Module
    """The model trained (PEFT's wrapper with --lora-rank)."""
    blocks: nn.ModuleList
    """Its block stack."""
    materialize: object = None
    """A Hugging Face model's block reader (``wrap``'s ``materialize``); None for our GPT."""
    hf_model: object = None
    """The ``models.hf.LazyHFModel`` of --model hf:DIR; None for our GPT."""
    lora: LoraSpec | None = None
    """The LoRA adapters of a --lora-rank run, targets as PEFT resolved them."""


def load_hf_model(run, groups=None):
    """The lazy Hugging Face model of ``run`` (its files checked, headers only), this rank's shard of
    its head and tail under --tp (each block's is taken as it is read)."""
    from pystronghold.models.hf import load_lazy

    hf_model = load_lazy(run.model.source)
    if run.model.tp_size > 1:
        from pystronghold.models.hf_tp import shard_hf_model

        shard_hf_model(hf_model, groups.tp_group)
    return hf_model


def build_model(run, groups=None, hf_model=None) -> ModelParts:
    """The model of ``run`` (a ``train.run.Run``): ``hf_model`` (``load_hf_model``'s) or our GPT,
    with its MLP tiles, LoRA adapters and --freeze. NOTE: our GPT's blocks are built by wrap()
    (``materialize_blocks=False``), so the fp32 model never exists whole."""
    tile, seed, ft = run.mlp_tile_tokens, run.config.run.seed, run.config.finetune
    if hf_model is not None:  # blocks always built one at a time from the shards (a model larger than the host)
        parts = ModelParts(model=hf_model.model, blocks=hf_model.blocks, materialize=hf_model.materialize,
                           hf_model=hf_model)
        if tile:
            log.info("MLP: %d of %d blocks run over tiles of %d positions", tile_mlps(parts.model, tile),
                     len(parts.blocks), tile)
    else:
        if tile:
            log.info("MLP: every block runs over tiles of %d positions", tile)
        model = GPT(dataclasses.replace(run.model, mlp_tile_tokens=tile), seed=seed,
                    tp_group=groups.tp_group if groups is not None else None, materialize_blocks=False)
        model.tail.loss_chunk_tokens = run.loss_chunk_tokens
        parts = ModelParts(model=model, blocks=model.blocks)
    if ft.lora_rank:  # PEFT wraps the model; its blocks stay ``blocks``
        from pystronghold.models.lora import add_lora

        parts.model, parts.lora = add_lora(hf_model if hf_model is not None else parts.model, ft.lora, seed)
    if ft.freeze is not None:
        freeze_matching(parts.model, ft.freeze)
    return parts


def build_engine(run, parts: ModelParts, runtime, groups=None):
    """(engine, pipeline stage or None) training ``parts`` with ``runtime`` (the run's RuntimeConfig
    completed by the Trainer): this rank's pipeline stage under --pp, else ``wrap``."""
    par = run.config.parallel
    if par.pp == 1:
        return wrap(parts.model, blocks=parts.blocks, materialize=parts.materialize, config=runtime), None
    from pystronghold.pipelining import gpt_pipeline, hf_pipeline

    if parts.hf_model is not None:
        pipeline = hf_pipeline(parts.hf_model, parts.model, groups, micro_batches=par.micro_batch_count,
                               loss_chunk_tokens=run.loss_chunk_tokens, schedule=par.pp_schedule,
                               chunks=par.pp_chunks, config=runtime)
    else:
        pipeline = gpt_pipeline(parts.model, groups, seq=run.seq, micro_batches=par.micro_batch_count,
                                schedule=par.pp_schedule, chunks=par.pp_chunks, config=runtime)
    return pipeline.engine, pipeline
