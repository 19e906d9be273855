"""Hugging Face causal LMs from a local directory, built one block at a time into the window store.

``from_pretrained(DIR, **wrap_options)`` (also ``pystronghold.from_pretrained``) and
``pystronghold train --model hf:DIR`` read ``DIR/config.json`` and the safetensors weights
(``model.safetensors`` or shards with ``model.safetensors.index.json``); nothing is downloaded.
The model is built the way ``GPT(materialize_blocks=False)`` is: its skeleton is constructed with
every parameter on the ``meta`` device (0 bytes; buffers such as rotary frequencies stay real),
the head and tail (embeddings, final norm, lm_head, tied or not) are read from the shards, and
``wrap(materialize=...)`` then reads block i's tensors only when it fills block i into the store.
So the whole model is never in host memory at once: with ``nvme_dir`` a model larger than host
memory is fine-tuned. Every tensor's presence, shape and dtype is checked from the shard headers
before anything is allocated. Weights are loaded as fp32 (the optimizer's masters).

Architectures: ``SUPPORTED`` (GPT-2, Llama, Mistral, Qwen2); others are refused with one line.
The cache is turned off (``use_cache=False``): a training forward must not append to a KV cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pystronghold.models.hf_shards import INDEX_NAME, SafetensorsShards

__all__ = ["SUPPORTED", "HFModelConfig", "read_hf_config", "LazyHFModel", "load_lazy", "from_pretrained",
           "causal_lm_loss", "HF_PREFIX", "read_weights", "weights_fingerprint"]

log = logging.getLogger(__name__)

HF_PREFIX = "hf:"
"""``--model hf:DIR`` names a Hugging Face model directory."""

SUPPORTED = {"GPT2LMHeadModel": "transformer.h", "LlamaForCausalLM": "model.layers",
             "MistralForCausalLM": "model.layers", "Qwen2ForCausalLM": "model.layers"}
"""Architecture (``config.json``'s ``architectures[0]``) -> dotted path of its block stack."""


@dataclass(kw_only=True, slots=True)
class HFModelConfig:
    """A Hugging Face model directory as a training run and its checkpoints record it."""

    source: str
    """Absolute path of the directory the weights were loaded from."""
    architecture: str
    """``config.json``'s ``architectures[0]``, one of ``SUPPORTED``."""
    config: dict = field(default_factory=dict)
    """``config.json`` as read (export writes it back)."""
    tp_size: int = 1
    """Tensor-parallel ranks; Hugging Face models train with 1 only."""

    def _get(self, *names: str) -> int:
        for name in names:
            if self.config.get(name) is not None:
                return int(self.config[name])
        raise ValueError(f"{self.source}/config.json: none of {', '.join(names)} is set")

    @property
    def seq_len(self) -> int:
        """Longest sequence the model takes (positions), tokens."""
        return self._get("max_position_embeddings", "n_positions")

    @property
    def heads(self) -> int:
        """Attention heads."""
        return self._get("num_attention_heads", "n_head")

    @property
    def vocab_size(self) -> int:
        """Vocabulary size (rows of the embedding)."""
        return self._get("vocab_size")

    @property
    def padded_vocab_size(self) -> int:
        """The vocabulary as stored (Hugging Face does not pad it)."""
        return self.vocab_size


def read_hf_config(directory: str | os.PathLike) -> HFModelConfig:
    """The ``HFModelConfig`` of ``directory`` (its config.json only; no weights read, no
    transformers import). ValueError naming the directory or the architecture otherwise."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"--model {HF_PREFIX}{directory}: no such directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {HF_PREFIX}{directory}: no config.json in the directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type", "unknown")
    if arch not in SUPPORTED:
        raise ValueError(f"{path / 'config.json'}: architecture {arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED)}")
    return HFModelConfig(source=str(path.resolve()), architecture=arch, config=config)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside the ``with`` goes to the ``meta`` device (0 bytes, and its
    initialisation is a no-op); buffers stay real. The idea of accelerate's ``init_empty_weights``:
    each parameter exists on the host only while its module's constructor runs, one at a time.
    NOTE: patches ``nn.Module.register_parameter`` process-wide for the duration (build models in
    one thread meanwhile), and writes the module's ``_parameters`` slot as ``register_parameter``
    itself does."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _aliases(module: nn.Module, skip: set[int] = frozenset()) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id(parameter) -> every (full name, owning module, attribute) it is reachable under (tied
    weights have several), for the modules not in ``skip``."""
    out: dict[int, list] = {}
    for mod_name, module in module.named_modules(remove_duplicate=False):
        if id(module) in skip:
            continue
        for name, p in module.named_parameters(recurse=False):
            out.setdefault(id(p), []).append((f"{mod_name}.{name}" if mod_name else name, module, name))
    return out


@dataclass(slots=True)
class LazyHFModel:
    """A Hugging Face model whose head and tail are loaded and whose blocks are still on ``meta``."""

    model: nn.Module
    """The transformers model (``use_cache`` off)."""
    blocks: nn.ModuleList
    """Its block stack (parameters on meta until ``materialize(i)``)."""
    blocks_name: str
    """Dotted path of ``blocks`` in ``model`` (``transformer.h``, ``model.layers``)."""
    shards: SafetensorsShards
    """The weights' reader."""
    spec: HFModelConfig
    adapters: object = None
    """Adapters added to the blocks after loading (``models.lora.add_lora``), or None: their
    ``stored_name(name)`` maps a block parameter's name to the shards' (None: an adapter's own
    parameter, which the shards do not hold), and ``initialize(block, i)`` gives block i's adapter
    parameters their initial values once its weights are read."""

    @torch.no_grad()
    def materialize(self, index: int) -> nn.Module:
        """Give block ``index`` its weights from the shards (fp32, on the host), and its adapters
        their initial values; returns the block."""
        block = self.blocks[index]
        prefix = f"{self.blocks_name}.{index}."
        for mod_name, module in block.named_modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    full = prefix + (f"{mod_name}.{name}" if mod_name else name)
                    stored = full if self.adapters is None else self.adapters.stored_name(full)
                    if stored is not None:
                        setattr(module, name, nn.Parameter(self.shards.read(stored), requires_grad=p.requires_grad))
        self.shards.close()  # unmap: the pages read would otherwise stay resident, block after block
        if self.adapters is not None:
            self.adapters.initialize(block, index)
        return block


def _model_on_meta(spec: HFModelConfig) -> nn.Module:
    """The model of ``spec``'s config.json with every parameter on ``meta`` (``use_cache`` off)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"{HF_PREFIX}{spec.source}: loading Hugging Face models needs transformers "
                         "(pip install 'pystronghold[hf]')") from None

    config = AutoConfig.from_pretrained(spec.source, local_files_only=True)
    config.use_cache = False  # NOTE: a training forward must not append to a KV cache
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _shards(spec: HFModelConfig, model: nn.Module) -> SafetensorsShards:
    prefix = getattr(model, "base_model_prefix", "")
    return SafetensorsShards(spec.source, strip_prefix=f"{prefix}." if prefix else "")


def read_weights(directory: str | os.PathLike):
    """Every weight of the model saved in ``directory`` by its model name (a tied weight once,
    under its first name), read one at a time as fp32: yields ``(name, tensor)``."""
    spec = read_hf_config(directory)
    model = _model_on_meta(spec)
    shards = _shards(spec, model)
    try:
        for aliases in _aliases(model).values():
            stored = next((name for name, _, _ in aliases if shards.key(name) is not None), aliases[0][0])
            yield aliases[0][0], shards.read(stored)
            shards.close()  # unmap: the pages read would otherwise stay resident
    finally:
        shards.close()


def weights_fingerprint(directory: str | os.PathLike) -> dict:
    """What identifies the model saved in ``directory`` without reading its weights: the sha256 of
    config.json (and of the shard index), and the size in bytes of every safetensors file."""
    path = Path(directory)
    out = {}
    for name in ("config.json", INDEX_NAME):
        if (path / name).is_file():
            out[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    for file in sorted(path.glob("*.safetensors")):
        out[file.name] = file.stat().st_size
    return out


def load_lazy(directory: str | os.PathLike) -> LazyHFModel:
    """Build the model of ``directory`` with its head and tail loaded and its blocks on ``meta``.

    Checks every tensor (present, shape as config.json makes it, float dtype) before loading any.
    """
    spec = read_hf_config(directory)
    model = _model_on_meta(spec)
    blocks_name = SUPPORTED[spec.architecture]
    blocks = model.get_submodule(blocks_name)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{spec.architecture}: {blocks_name} is not an nn.ModuleList")
    shards = _shards(spec, model)
    block_modules = {id(m) for m in blocks.modules()}
    head_tail = _aliases(model, skip=block_modules)
    for name, p in model.named_parameters():  # the blocks' tensors
        if id(p) not in head_tail:
            shards.check(name, p.shape)
    for aliases in head_tail.values():  # a tied weight may be stored under any of its names
        stored = [name for name, _, _ in aliases if shards.key(name) is not None]
        shards.check(stored[0] if stored else aliases[0][0], model.get_parameter(aliases[0][0]).shape)
    with torch.no_grad():
        for aliases in head_tail.values():
            stored = next(name for name, _, _ in aliases if shards.key(name) is not None)
            old = model.get_parameter(aliases[0][0])
            p = nn.Parameter(shards.read(stored), requires_grad=old.requires_grad)
            for _, module, attr in aliases:
                setattr(module, attr, p)
    shards.close()
    log.info("%s: %s, %d blocks at %s, head and tail loaded; blocks load one at a time",
             spec.source, spec.architecture, len(blocks), blocks_name)
    return LazyHFModel(model=model, blocks=blocks, blocks_name=blocks_name, shards=shards, spec=spec)


def from_pretrained(directory: str | os.PathLike, **wrap_options):
    """Fine-tune the Hugging Face causal LM in local ``directory``: ``pystronghold.wrap`` of it, its
    blocks read from the safetensors shards one at a time into the store (see the module docstring).

    ``wrap_options`` are ``wrap``'s (window, device, precision, optimizer, nvme_dir, ...). Returns the
    Engine; ``engine.model`` is the transformers model::

        engine = pystronghold.from_pretrained("llama-dir", window=2, nvme_dir="/nvme")
        loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()
    """
    import pystronghold

    lazy = load_lazy(directory)
    try:
        return pystronghold.wrap(lazy.model, blocks=lazy.blocks, materialize=lazy.materialize, **wrap_options)
    finally:
        lazy.shards.close()


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T), which are
    already shifted (``targets[:, t]`` follows ``inputs[:, t]``), over the targets that are not -100
    (0, with no gradient, when every one is). Computed in fp32."""
    flat = targets.flatten()
    # NOTE: a sum over a count clamped to 1, not reduction="mean": that is 0/0 = NaN (and NaN
    # gradients) for a window of prompt tokens only; no host synchronization either way.
    total = nn.functional.cross_entropy(logits.float().flatten(0, 1), flat, ignore_index=-100, reduction="sum")
    return total / (flat != -100).sum().clamp(min=1)
