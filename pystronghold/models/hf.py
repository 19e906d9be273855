"""Hugging Face causal LMs from a local directory, built one block at a time into the window store.

``pystronghold.from_pretrained(DIR, **wrap_options)`` and ``train --model hf:DIR`` read
``DIR/config.json`` and the safetensors weights (nothing is downloaded). The skeleton is built on
``meta``, head and tail are read from the shards, and each block's tensors are read only when it
is filled into the store, so the whole model is never in host memory at once. Weights load as
fp32; ``use_cache`` is off. Refused with one line: remote code, encoder-decoder models, unknown
``model_type``, no single stack of ``num_hidden_layers`` blocks, a conversion mixing blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pystronghold.models.hf_convert import HEAD_TAIL, CheckpointPlan, hub_layout
from pystronghold.models.hf_shards import INDEX_NAME, SafetensorsShards
from pystronghold.options import ConfigError, first_line
from pystronghold.parallel.layers import tp_shard_parameter

__all__ = ["HF_DEFAULT_SEQ", "POSITION_KEYS", "NO_POSITION_LIMIT", "HFModelConfig", "read_hf_config", "LazyHFModel", "load_lazy", "meta_model",
           "block_stack", "hub_weights", "HF_PREFIX", "read_weights", "weights_fingerprint",
           "HASH_CHUNK", "FINGERPRINT_IDENTITY"]

log = logging.getLogger(__name__)

HF_PREFIX = "hf:"
"""``--model hf:DIR`` names a Hugging Face model directory."""

HF_DEFAULT_SEQ = 512
"""Tokens per sequence of a ``--model hf:DIR`` run (and plan) without --seq when the model names no
positions (ALiBi), at most what fits; a model with positions defaults to them, capped by what fits
(``planner.sequence.default_context``)."""

POSITION_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length")
"""config.json's names for the longest sequence a model takes."""
NO_POSITION_LIMIT = 1 << 20
"""The positions of a model whose config names none (BLOOM's ALiBi has no position table), tokens."""

@dataclass(kw_only=True, slots=True)
class HFModelConfig:
    """A Hugging Face model directory as a training run and its checkpoints record it."""

    source: str
    """Absolute path of the directory the weights were loaded from."""
    architecture: str
    """``config.json``'s ``architectures[0]`` (its ``model_type`` when it names none)."""
    config: dict = field(default_factory=dict)
    """``config.json`` as read (export writes it back)."""
    tp_size: int = 1
    """Tensor-parallel ranks (--tp) the blocks, embedding and LM head are split across (``models.hf_tp``)."""

    def _get(self, *names: str) -> int:
        for name in names:
            if self.config.get(name) is not None:
                return int(self.config[name])
        raise ValueError(f"{self.source}/config.json: none of {', '.join(names)} is set")

    @property
    def seq_len(self) -> int:
        """Longest sequence the model takes (positions; ``NO_POSITION_LIMIT`` when config.json
        names none), tokens."""
        return next((int(self.config[k]) for k in POSITION_KEYS if self.config.get(k)), NO_POSITION_LIMIT)

    @property
    def model_type(self) -> str:
        """``config.json``'s ``model_type`` (``llama``, ``mixtral``, ...)."""
        return self.config["model_type"]

    @property
    def heads(self) -> int:
        """Attention heads."""
        return self._get("num_attention_heads", "n_head")

    @property
    def layers(self) -> int:
        """Blocks (``num_hidden_layers``)."""
        return self._get("num_hidden_layers", "n_layer")

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
    transformers import). ValueError naming the directory, or what makes the model one that cannot
    be streamed (no ``model_type``, remote code)."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"--model {HF_PREFIX}{directory}: no such directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model {HF_PREFIX}{directory}: no config.json in the directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ValueError(f"{path / 'config.json'}: no model_type (not a transformers model config)")
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config["model_type"]
    if config.get("auto_map"):
        raise ValueError(f"{path / 'config.json'}: {arch} is remote code (auto_map), which pystronghold does not "
                         "run; only models built by the installed transformers' own code load")
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
    plan: CheckpointPlan
    """Which stored tensors make each block's parameters."""
    adapters: object = None
    """Adapters added to the blocks after loading (``models.lora.add_lora``), or None: their
    ``stored_name(name)`` maps a block parameter's name to the base model's (None: an adapter's own
    parameter, which the shards do not hold), and ``initialize(block, i)`` gives block i's adapter
    parameters their initial values once its weights are read."""

    @torch.no_grad()
    def materialize(self, index: int) -> nn.Module:
        """Give block ``index`` its weights from the shards (fp32, on the host), and its adapters
        their initial values; returns the block."""
        block = self.blocks[index]
        prefix = f"{self.blocks_name}.{index}."
        made = {name: t for part in self.plan.tensors(index) for name, t in part.items()}
        self.shards.close()  # unmap: the pages read would otherwise stay resident, block after block
        for mod_name, module in block.named_modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    full = prefix + (f"{mod_name}.{name}" if mod_name else name)
                    stored = full if self.adapters is None else self.adapters.stored_name(full)
                    if stored is not None:
                        setattr(module, name, _parameter_like(p, made[stored]))
        _load_buffers(block, prefix, made)
        if self.adapters is not None:
            self.adapters.initialize(block, index)
        return block


def _parameter_like(meta: nn.Parameter, full: torch.Tensor) -> nn.Parameter:
    """The parameter that replaces ``meta`` given the stored ``full`` tensor: ``full`` itself, or this
    rank's slice of it for a tensor-parallel shard (``tp_split``: ``models.hf_tp``)."""
    split = getattr(meta, "tp_split", None)
    if split is None:
        return nn.Parameter(full, requires_grad=meta.requires_grad)
    return tp_shard_parameter(full, split, meta.requires_grad)


def _load_buffers(module: nn.Module, prefix: str, made: dict[str, torch.Tensor]) -> None:
    """Copy the stored values of ``module``'s persistent buffers (named ``prefix`` + their name in
    ``made``) into them."""
    for name, buffer in module.named_buffers():
        if prefix + name in made:
            buffer.copy_(made[prefix + name])


def meta_model(spec: HFModelConfig) -> nn.Module:
    """The model of ``spec``'s config (as recorded) with every parameter on ``meta`` (``use_cache`` off),
    built by transformers' ``AutoModelForCausalLM.from_config``. ValueError (one line) when
    transformers is missing, does not know the ``model_type``, or builds no causal LM for it."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"{HF_PREFIX}{spec.source}: loading Hugging Face models needs transformers "
                         "(pip install 'pystronghold[hf]')") from None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    where = f"{spec.source}/config.json"
    model_type = spec.config["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: model_type {model_type!r} is unknown to transformers {transformers.__version__} "
                         "(a newer transformers may know it; remote code is not run)")
    try:  # NOTE: from the recorded config.json, so that an export works after the source has moved
        config = CONFIG_MAPPING[model_type].from_dict(spec.config)
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: transformers {transformers.__version__} cannot read it "
                         f"(model_type {spec.config.get('model_type')!r}): {first_line(e)}") from None
    config.name_or_path = spec.source
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{where}: {spec.architecture} is an encoder-decoder model; only causal LMs (one stack of "
                         "decoder blocks) load")
    config.use_cache = False  # NOTE: a training forward must not append to a KV cache
    attention = _attention_implementation(config, where)
    try:
        with _parameters_on_meta():
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attention)
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        raise ValueError(f"{where}: transformers {transformers.__version__} builds no causal LM for model_type "
                         f"{config.model_type!r} ({first_line(e)})") from None


def _attention_implementation(config, where: str) -> dict:
    """``from_config``'s keyword for attention: SDPA (flash / memory-efficient kernels, no T x T
    scores; no T x T mask for an unpadded causal batch in transformers 5) whatever config.json
    asks, unless the family has none (Gemma 2's soft-capped scores, GPT-J, BLOOM's ALiBi): then
    its own, said once."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kind = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None
    if kind is None:
        return {}  # NOTE: refused in one line by from_config's caller
    if getattr(kind, "_supports_sdpa", False):
        return {"attn_implementation": "sdpa"}
    log.info("%s: %s has no SDPA attention in transformers: its own attention holds T x T scores per head",
             where, kind.__name__)
    return {}


def block_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(dotted path, stack)`` of the transformers ``model``'s block stack: its one ``nn.ModuleList``
    (not inside another) of ``num_hidden_layers`` modules (the text config's, for a model that has
    several). ValueError (one line) when there is none or more than one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None)
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList):
                if len(child) == layers:
                    found.append((prefix + name, child))
                continue  # a ModuleList inside another is part of one block
            visit(child, f"{prefix}{name}.")

    visit(model, "")
    if len(found) != 1:
        what = "none" if not found else ", ".join(name for name, _ in found)
        raise ValueError(f"{type(model).__name__}: expected one nn.ModuleList of num_hidden_layers={layers} blocks "
                         f"to stream, found {what}")
    return found[0]


def _loader(spec: HFModelConfig) -> tuple[nn.Module, str, nn.ModuleList, SafetensorsShards, CheckpointPlan]:
    """The model on meta, its block stack, the shards and the checked plan of what they make."""
    model = meta_model(spec)
    blocks_name, blocks = block_stack(model)
    shards = SafetensorsShards(spec.source)
    plan = CheckpointPlan(model, shards, blocks_name)
    for aliases in _aliases(model).values():  # a tied weight may be stored under any of its names
        if not any(name in plan.made for name, _, _ in aliases):
            raise ValueError(f"{spec.source}: no tensor {aliases[0][0]!r} in the safetensors files (the "
                             "checkpoint does not match config.json)")
    return model, blocks_name, blocks, shards, plan


def read_weights(directory: str | os.PathLike):
    """Every weight of the model saved in ``directory`` by its model name (a tied weight once,
    under its first name), read and converted a group at a time (head and tail, then block by
    block) as fp32: yields ``(name, tensor)``."""
    model, _, blocks, shards, plan = _loader(read_hf_config(directory))
    first = {name: aliases[0][0] for aliases in _aliases(model).values() for name, _, _ in aliases}
    done: set[str] = set()
    try:
        for block in (HEAD_TAIL, *range(len(blocks))):
            for part in plan.tensors(block):
                for name, tensor in part.items():
                    if first.get(name) is not None and first[name] not in done:  # not a buffer, not seen
                        done.add(first[name])
                        yield first[name], tensor
            shards.close()  # unmap: the pages read would otherwise stay resident
    finally:
        shards.close()


def hub_weights(model: nn.Module, weight_dicts):
    """``weight_dicts`` (dicts of the transformers ``model``'s tensors by its names) in the layout of
    the family's checkpoints, a block at a time (``models.hf_convert.hub_layout``)."""
    return hub_layout(model, block_stack(model)[0], weight_dicts)


# ---- what identifies a base model's files

HASH_CHUNK = 64 << 20
"""Bytes of a safetensors file hashed per ``crc32c`` call (the file's value is the crc32c of the
chunks' crc32c values, little-endian uint32), bytes."""
FINGERPRINT_IDENTITY = ("bytes", "crc32c")
"""The fields of a safetensors file's fingerprint entry that identify its contents; its ``"stat"``
is only the cache key under which its ``crc32c`` is trusted without reading the file."""

_hashed: dict[tuple, str] = {}
"""(directory, file name, size, mtime_ns, ctime_ns, inode) -> crc32c of the file: what this process has
hashed or trusted, so a second fingerprint of unchanged files reads nothing."""
_hashing = threading.Lock()


def _stat_key(path: Path) -> list[int]:
    """``[size, mtime_ns, ctime_ns, inode]``: any write through the file system, a replacement by
    rename, or an mtime set back (which sets ctime to now) changes it."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _file_crc32c(path: Path) -> str:
    """crc32c of ``path``'s bytes, read ``HASH_CHUNK`` at a time into one buffer (``HASH_CHUNK``)."""
    from pystronghold.ops import crc32c

    buffer = bytearray(HASH_CHUNK)
    view = torch.frombuffer(buffer, dtype=torch.uint8)  # (HASH_CHUNK,)
    chunks = []
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            chunks.append(crc32c(view[:n]))
    # NOTE: the op takes no running value, so chunks are combined as the file tier's segments are
    combined = crc32c(torch.tensor(chunks, dtype=torch.int64).to(torch.int32).view(torch.uint8))
    return f"{combined:08x}"


def weights_fingerprint(directory: str | os.PathLike, known: dict | None = None) -> dict:
    """What identifies the model saved in ``directory``: the sha256 of config.json (and of the shard
    index) and, per safetensors file, ``{"bytes", "crc32c", "stat"}`` (``FINGERPRINT_IDENTITY``).

    Files are hashed (``_file_crc32c``) only when neither this process nor ``known`` (a fingerprint
    recorded earlier, e.g. a checkpoint manifest's) holds a crc32c under the file's current path and
    ``stat`` (size, mtime, ctime, inode): resuming from an unchanged base reads no weights twice."""
    path = Path(directory)
    out: dict = {}
    for name in ("config.json", INDEX_NAME):
        if (path / name).is_file():
            out[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    root = str(path.resolve())
    for name, entry in (known or {}).items():
        if isinstance(entry, dict) and "stat" in entry:
            _hashed.setdefault((root, name, entry["bytes"], *entry["stat"]), entry["crc32c"])
    done, start = 0, time.perf_counter()
    with _hashing:
        for file in sorted(path.glob("*.safetensors")):
            stat = _stat_key(file)
            key = (root, file.name, *stat)
            if key not in _hashed:
                _hashed[key] = _file_crc32c(file)
                done += stat[0]
            out[file.name] = {"bytes": stat[0], "crc32c": _hashed[key], "stat": stat[1:]}
    if done:
        log.info("%s: hashed %d bytes of safetensors (crc32c) in %.1f s: the base's fingerprint", root, done,
                 time.perf_counter() - start)
    return out


def load_lazy(directory: str | os.PathLike) -> LazyHFModel:
    """Build the model of ``directory`` with its head and tail loaded and its blocks on ``meta``.

    Checks every tensor (made by the stored ones, shape as config.json makes it, float dtype)
    before loading any.
    """
    spec = read_hf_config(directory)
    model, blocks_name, blocks, shards, plan = _loader(spec)
    block_modules = {id(m) for m in blocks.modules()}
    made = {name: t for part in plan.tensors(HEAD_TAIL) for name, t in part.items()}
    with torch.no_grad():
        for aliases in _aliases(model, skip=block_modules).values():
            stored = next(name for name, _, _ in aliases if name in made)
            old = model.get_parameter(aliases[0][0])
            p = nn.Parameter(made[stored], requires_grad=old.requires_grad)
            for _, module, attr in aliases:
                setattr(module, attr, p)
        _load_buffers(model, "", made)  # the head and tail's: only they are in ``made``
    shards.close()
    log.info("%s: %s, %d blocks at %s, head and tail loaded; blocks load one at a time",
             spec.source, spec.architecture, len(blocks), blocks_name)
    return LazyHFModel(model=model, blocks=blocks, blocks_name=blocks_name, shards=shards, spec=spec, plan=plan)
