"""``pystronghold export CKPT OUTDIR --hf``: a ``--model hf:DIR`` checkpoint as a Hugging Face directory.

Writes ``config.json`` (dtype float32: the fp32 masters), safetensors shards of at most
``max_shard_bytes`` with their index in the family's own layout, and the source's tokenizer files
(a source that lost them is refused before anything is written). A LoRA checkpoint exports PEFT
adapters, or with ``merge`` a plain model with the adapters merged. Memory holds at most one shard
plus one block; output goes to a temporary sibling renamed when complete. ``save_pretrained(engine,
OUTDIR)`` does the same from a live engine. Checkpoints of pystronghold's own GPT are refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from pystronghold.models.hf import HFModelConfig, hub_weights, meta_model, read_weights
from pystronghold.models.lora import ADAPTER, PEFT_PREFIX, adapter_key, lora_config, merged
from pystronghold.options import ConfigError
from pystronghold.settings.finetune import LoraSpec
from pystronghold.tokenized import TOKENIZER_FILES, has_tokenizer
from pystronghold.train.checkpoint import CheckpointError, checkpoint_weights, read_manifest, save_safetensors
from pystronghold.train.checkpoint_finetune import check_base

__all__ = ["export_hf", "save_pretrained", "DEFAULT_SHARD_BYTES", "COPIED_FILES"]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 2 << 30
"""Most bytes of tensor data per safetensors shard (2 GiB)."""
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
"""Files of the source directory copied beside the weights (when present)."""


def _hf_spec(path: Path, manifest: dict) -> HFModelConfig:
    model = manifest.get("model", {})
    if not {"source", "architecture", "config"} <= set(model):
        raise CheckpointError(f"checkpoint {path} holds pystronghold's own GPT, not a model loaded with "
                              "--model hf:DIR; export it with `pystronghold export CKPT OUT.safetensors`")
    return HFModelConfig(**{k: model[k] for k in ("source", "architecture", "config")})


def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer_dir: str | os.PathLike | None = None,
              copy_tokenizer: bool = True, merge: bool = False) -> Path:
    """Write checkpoint ``checkpoint`` as a Hugging Face model directory ``out`` (see the module
    docstring), or a LoRA run's adapters in PEFT's format (merged into the model with ``merge``);
    ``out`` must not exist or be empty. The tokenizer and generation files come from
    ``tokenizer_dir``, by default the run's ``--model hf:DIR``; none with ``copy_tokenizer=False``.
    Returns ``out``. CheckpointError for a checkpoint that is corrupt, was not made from a Hugging
    Face model, or whose base has changed; ValueError for a bad ``out``, ``merge`` of a checkpoint
    without adapters, or a tokenizer source without a tokenizer."""
    path, out = Path(checkpoint), Path(out)
    _check_output(out, max_shard_bytes)
    manifest = read_manifest(path)
    spec = _hf_spec(path, manifest)
    lora = (manifest.get("finetune") or {}).get("lora")
    if merge and not lora:
        raise ConfigError(f"--merge: checkpoint {path} holds no LoRA adapters (not a --lora-rank run); "
                          "export --hf writes its whole model as it is")
    check_base(manifest, path, "export")
    source = _tokenizer_source(spec.source, tokenizer_dir) if copy_tokenizer else None
    trained = checkpoint_weights(path, manifest)
    if lora and not merge:
        lora = LoraSpec.from_record(lora)
        adapters = {name: t for part in trained for name, t in part.items()}
        _write_directory(out, lambda tmp: _write_adapters(tmp, adapters, lora, spec), source=source)
        log.info("export: %s (%s, step %d) -> %s: %d LoRA adapter tensors (rank %d)", path, spec.architecture,
                 manifest["step"], out, len(adapters), lora.rank)
        return out
    if lora:
        weights = _merged_weights(spec, {name: t for part in trained for name, t in part.items()},
                                  LoraSpec.from_record(lora))
    elif manifest.get("base") is not None:
        weights = _completed_weights(spec, trained)
    else:
        weights = trained
    weights = hub_weights(meta_model(spec), weights)
    names = _write_directory(out, lambda tmp: _write_model(tmp, weights, spec.config, max_shard_bytes),
                             source=source)
    copied = [n for n in COPIED_FILES if (out / n).is_file()]
    log.info("export: %s (%s, step %d) -> %s: %d shard(s)%s", path, spec.architecture, manifest["step"], out,
             len(names), f", copied {', '.join(copied)}" if copied else "")
    return out


def _write_adapters(out: Path, adapters: dict[str, torch.Tensor], lora: LoraSpec, spec: HFModelConfig) -> list[str]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` (``adapters`` by model name) into ``out``."""
    lora_config(lora, spec.architecture, spec.source).save_pretrained(str(out))
    save_safetensors({adapter_key(n): t.float().contiguous() for n, t in adapters.items()},
                     out / "adapter_model.safetensors", metadata={"format": "pt"})
    return ["adapter_model.safetensors"]


def _merged_weights(spec: HFModelConfig, adapters: dict[str, torch.Tensor], lora: LoraSpec):
    """The base model's weights (one tensor at a time) with every adapter merged into its layer's weight."""
    merged_count = 0
    for name, tensor in read_weights(spec.source):
        module = name.removesuffix(".weight")
        a = adapters.get(f"{PEFT_PREFIX}{module}.lora_A.{ADAPTER}.weight")
        if a is not None:
            tensor = merged(tensor, a, adapters[f"{PEFT_PREFIX}{module}.lora_B.{ADAPTER}.weight"], lora,
                            spec.architecture)
            merged_count += 1
        yield {name: tensor}
    if 2 * merged_count != len(adapters):
        raise CheckpointError(f"--merge: the checkpoint holds {len(adapters)} adapter tensors, {merged_count} "
                              "pairs of which matched a weight of the base model")


def _completed_weights(spec: HFModelConfig, trained):
    """The checkpoint's trained weights, then the base directory's others (the frozen ones)."""
    names = set()
    for part in trained:
        names.update(part)
        yield part
    for name, tensor in read_weights(spec.source):
        if name not in names:
            yield {name: tensor}


def save_pretrained(engine, out: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write the Hugging Face model trained by ``engine`` (made by ``pystronghold.from_pretrained``)
    as a directory ``out`` that ``AutoModelForCausalLM.from_pretrained`` loads: the fp32 masters
    (blocks read from the store) in the family's checkpoint layout, ``engine.model.config`` with
    ``use_cache`` on and ``dtype`` float32, its generation config, and the tokenizer files of
    ``tokenizer_dir`` (ValueError when it holds none), by default of the directory the model was
    loaded from when that holds a tokenizer. ``out`` must not exist or be empty. Returns ``out``.
    NOTE: masters held on disk (the NVMe tier) are all read into host memory here; for a model
    larger than host memory save a checkpoint and use ``export_hf`` (one block at a time)."""
    out = Path(out)
    _check_output(out, max_shard_bytes)
    if tokenizer_dir is not None and not has_tokenizer(tokenizer_dir):
        raise ValueError(f"save_pretrained: tokenizer_dir {tokenizer_dir} holds no tokenizer (none of "
                         f"{', '.join(TOKENIZER_FILES)})")
    model_config = getattr(engine.model, "config", None)
    if model_config is None or not hasattr(model_config, "to_dict"):
        raise TypeError(f"save_pretrained: engine.model is a {type(engine.model).__name__}, not a Hugging "
                        "Face model (use pystronghold.from_pretrained)")
    config = dict(model_config.to_dict(), use_cache=True, architectures=[type(engine.model).__name__])
    weights = hub_weights(engine.model, [engine.master_parameters()])  # views of the store until written
    loaded_from = getattr(model_config, "name_or_path", "")
    if tokenizer_dir is None and loaded_from and has_tokenizer(loaded_from):
        tokenizer_dir = loaded_from

    def fill(tmp: Path) -> list[str]:
        generation = getattr(engine.model, "generation_config", None)
        if generation is not None:  # the source's own generation_config.json, if any, is copied over it
            generation.save_pretrained(str(tmp))
        return _write_model(tmp, weights, config, max_shard_bytes)

    names = _write_directory(out, fill, source=tokenizer_dir)
    log.info("save_pretrained: %s -> %s: %d shard(s)", type(engine.model).__name__, out, len(names))
    return out


def _tokenizer_source(run_source: str, tokenizer_dir: str | os.PathLike | None) -> Path:
    """``tokenizer_dir``, else the run's ``--model hf:DIR``: checked to hold a tokenizer before any
    weight is written (the source directory may have moved since the run); ValueError saying how to
    give another when it does not."""
    source = Path(tokenizer_dir if tokenizer_dir is not None else run_source)
    if not has_tokenizer(source):
        where = (f"--tokenizer {source}" if tokenizer_dir is not None
                 else f"the tokenizer source {source} (the run's --model hf:DIR)")
        state = "does not exist" if not source.is_dir() else f"holds none of {', '.join(TOKENIZER_FILES)}"
        raise ValueError(f"{where} {state}; give --tokenizer DIR (a directory holding the model's tokenizer "
                         "files), or --no-tokenizer to export the model alone")
    return source


def _check_output(out: Path, max_shard_bytes: int) -> None:
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory")


def _write_model(out: Path, weight_dicts, config: dict, max_shard_bytes: int) -> list[str]:
    """Shards + index of ``weight_dicts`` and config.json (fp32) into ``out``; returns the shard names."""
    names = _write_shards(weight_dicts, out, max_shard_bytes)
    config = dict(config, dtype="float32")
    if "torch_dtype" in config:
        config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return names


def _write_directory(out: Path, fill, source: str | os.PathLike | None = None) -> list[str]:
    """``fill(tmp)`` (returning the names of the weight files it wrote) and the tokenizer files of
    ``source`` (none when None) into a temporary sibling ``tmp`` of ``out``, renamed into place."""
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        names = fill(tmp)
        if source is not None:
            for name in COPIED_FILES:
                if (Path(source) / name).is_file():
                    shutil.copyfile(Path(source) / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked by the caller)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _write_shards(weight_dicts, out: Path, max_shard_bytes: int) -> list[str]:
    """Write the weights (an iterable of name -> tensor dicts) as ``model-0000i-of-0000n.safetensors`` (or one
    ``model.safetensors``) plus the index; returns the shard file names."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0
    written: list[str] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            name = f"part-{len(written):05d}.safetensors"
            save_safetensors(current, out / name, metadata={"format": "pt"})
            written.append(name)
            shards.append({k: None for k in current})
            current, current_bytes = {}, 0

    for weights in weight_dicts:
        for name, tensor in weights.items():
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > max_shard_bytes:
                flush()
            current[name] = tensor.detach().float().cpu().contiguous()
            current_bytes += size
            total += size
    flush()
    if len(written) == 1:
        os.replace(out / written[0], out / "model.safetensors")
        return ["model.safetensors"]
    final = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for tmp_name, name, keys in zip(written, final, shards):
        os.replace(out / tmp_name, out / name)
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return final
