"""``pystronghold.wrap``: the one call that turns a model into a windowed training engine; and
``pystronghold.from_pretrained``, ``wrap`` of a Hugging Face model loaded block by block."""

from __future__ import annotations

import logging
import os
import weakref

import torch

from pystronghold.runtime.config import RuntimeConfig

__all__ = ["wrap", "from_pretrained"]

log = logging.getLogger(__name__)

_WRAPPED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
"""Models and blocks that ``wrap`` made an engine of: their weights now live in its store (the
blocks' own parameters are emptied), so a second engine of them would train nothing real."""


def wrap(model: torch.nn.Module, *, blocks: torch.nn.ModuleList | None = None, materialize=None,
         config: RuntimeConfig | None = None, **options):
    """Train ``model`` with only ``window`` of its ``blocks`` on the device at a time; returns an Engine.

    ``blocks``: the model's ``nn.ModuleList`` of blocks (``find_blocks`` finds it when omitted).
    ``options`` are ``RuntimeConfig`` fields (window, device, precision, optimizer, nvme_dir, parallel:
    each rank wraps its own replica, ...), or ``config=`` one ``RuntimeConfig``, not both (TypeError).
    Blocks on ``meta`` are materialized one at a time by ``materialize(i)`` (default: ``materialize_block_``)::

        engine = pystronghold.wrap(model, blocks=model.blocks, window=4, optimizer=pystronghold.AdamW(lr=3e-4))
        loss = engine(x, y); engine.backward(loss); engine.step(); engine.zero_grad()
    """
    from pystronghold.runtime.engine import Engine

    if config is not None and options:
        raise TypeError(f"wrap: give config= or options ({', '.join(options)}), not both")
    if isinstance(model, Engine):
        raise TypeError("wrap: model is already an Engine (made by pystronghold.wrap); train it as it is")
    config = config if config is not None else RuntimeConfig(**options)
    if config.window == "auto":
        raise ValueError("wrap: window='auto' is chosen from measured block times before wrap "
                         "(pystronghold train --window auto); wrap takes an int >= 1 or 'all'")
    if config.resident_blocks == "auto":
        raise ValueError("wrap: resident_blocks='auto' is chosen by the planner before wrap "
                         "(pystronghold train --window auto); wrap takes an int >= 0")
    if blocks is None:
        from pystronghold.runtime.blocks.discovery import find_blocks

        name, blocks = find_blocks(model)
        log.info("wrap: using %r (%d blocks) as the block stack", name, len(blocks))
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(f"wrap: blocks= must be an nn.ModuleList, got {type(blocks).__name__}")
    if model in _WRAPPED or any(block in _WRAPPED for block in blocks):
        raise ValueError(f"wrap: this {type(model).__name__} is already wrapped (its weights live in the engine "
                         "an earlier wrap made); keep using that engine, or wrap a new model")
    from pystronghold.runtime.blocks.purity import disable_hf_cache

    engine = Engine(model, blocks, config, materialize=materialize)
    _WRAPPED.update([model, *blocks])
    disable_hf_cache(model)
    return engine


def from_pretrained(directory: str | os.PathLike, **wrap_options):
    """Fine-tune the Hugging Face causal LM in local ``directory``: ``wrap`` of it, its blocks read
    from the safetensors shards one at a time into the store (``models.hf.load_lazy``).

    ``wrap_options`` are ``wrap``'s (window, device, precision, optimizer, nvme_dir, ...). Returns the
    Engine; ``engine.model`` is the transformers model::

        engine = pystronghold.from_pretrained("llama-dir", window=2, nvme_dir="/nvme")
        loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()
    """
    from pystronghold.models.hf import load_lazy  # NOTE: needs the [hf] extra (safetensors, transformers)

    lazy = load_lazy(directory)
    try:
        return wrap(lazy.model, blocks=lazy.blocks, materialize=lazy.materialize, **wrap_options)
    finally:
        lazy.shards.close()
