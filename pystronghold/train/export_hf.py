"""``pystronghold export CKPT OUTDIR --hf``: a checkpoint of a ``--model hf:DIR`` run, written back as a
Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained(OUTDIR)`` loads.

The checkpoint's manifest records the model as ``HFModelConfig`` (source directory, architecture,
config.json). The export writes ``config.json`` (that config, ``dtype`` float32: the weights are the
optimizer's fp32 masters, so the exported model gives the trained engine's fp32 logits), the weights
as safetensors shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (keys
are the model's own parameter names, tied weights stored once, as ``save_pretrained`` does), and
copies the tokenizer and generation files of the source directory when it still has them. The
checkpoint is read one block file at a time, so at most one shard plus one block is in memory.
Everything goes to a temporary sibling directory first, renamed to OUTDIR when complete.

Checkpoints of pystronghold's own GPT are refused (export them with ``pystronghold export CKPT
OUT.safetensors``): its layout is not one of the Hugging Face architectures.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pystronghold.models.hf import HFModelConfig
from pystronghold.train.checkpoint import CheckpointError, checkpoint_weights, read_manifest

__all__ = ["export_hf", "DEFAULT_SHARD_BYTES", "COPIED_FILES"]

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
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write checkpoint ``checkpoint`` as a Hugging Face model directory ``out`` (see the module
    docstring); ``out`` must not exist or be empty. Returns ``out``. CheckpointError for a checkpoint
    that is corrupt or was not made from a Hugging Face model; ValueError for a bad ``out``."""
    path, out = Path(checkpoint), Path(out)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty directory")
    manifest = read_manifest(path)
    spec = _hf_spec(path, manifest)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        names = _write_shards(path, manifest, tmp, max_shard_bytes)
        config = dict(spec.config, dtype="float32")
        if "torch_dtype" in config:
            config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = [n for n in COPIED_FILES if (Path(spec.source) / n).is_file()]
        for name in copied:
            shutil.copyfile(Path(spec.source) / name, tmp / name)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("export: %s (%s, step %d) -> %s: %d shard(s)%s", path, spec.architecture, manifest["step"], out,
             len(names), f", copied {', '.join(copied)}" if copied else "")
    return out


def _write_shards(path: Path, manifest: dict, out: Path, max_shard_bytes: int) -> list[str]:
    """Write the checkpoint's weights as ``model-0000i-of-0000n.safetensors`` (or one
    ``model.safetensors``) plus the index; returns the shard file names."""
    shards: list[dict[str, torch.Tensor]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0
    written: list[str] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            name = f"part-{len(written):05d}.safetensors"
            save_file(current, str(out / name), metadata={"format": "pt"})
            written.append(name)
            shards.append({k: None for k in current})
            current, current_bytes = {}, 0

    for weights in checkpoint_weights(path, manifest):
        for name, tensor in weights.items():
            size = tensor.numel() * tensor.element_size()
            if current and current_bytes + size > max_shard_bytes:
                flush()
            current[name] = tensor.contiguous()
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
