"""Checkpoints of a training run: streamed block by block, atomic, checksummed, window-independent.

A checkpoint ``<dir>/step-00000100/`` holds one safetensors file per block (fp32 masters and AdamW
moments by full parameter name), ``head_tail.safetensors``, ``state.pt`` (step and each state
object's ``state_dict()``: engine, schedule, optimizer settings, data position, RNG) and
``manifest.json`` (config, lineage, sha256 of every file). It does not depend on the window size
or the PP x TP x DP layout that wrote it. The state objects are ``checkpoint_state.py``'s, the
files ``checkpoint_files.py``'s, writing ``checkpoint_save.py``'s and reading (every checksum
verified before anything changes; ``CheckpointError``, one line) ``checkpoint_load.py``'s; this
module gathers them and exports a checkpoint's weights. Directory naming and locking are
``checkpoint_dir.py``'s, which checkpoint a resume takes and what it does with the options given
again ``resume.py``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pystronghold.models.lora import GPT_ARCHITECTURE, merged_state_dict
from pystronghold.settings.finetune import LoraSpec
from pystronghold.train.checkpoint_dir import CheckpointError, read_manifest
from pystronghold.train.checkpoint_files import read_tensors
from pystronghold.train.checkpoint_load import load_checkpoint
from pystronghold.train.checkpoint_save import CheckpointWriteError, SaveInterrupted, save_checkpoint

__all__ = ["CheckpointError", "CheckpointWriteError", "SaveInterrupted", "save_checkpoint", "load_checkpoint",
           "read_manifest", "checkpoint_weights", "export_weights", "save_safetensors"]


# ---- export

def checkpoint_weights(path: str | os.PathLike, manifest: dict):
    """The fp32 weights of checkpoint ``path`` (its ``manifest``, from ``read_manifest``), one file at
    a time: yields ``{model parameter name: tensor}`` per block file, then the head/tail file
    (optimizer moments left out; a frozen parameter, kept in the compute dtype, cast to fp32), so a
    caller holds one block's weights at a time."""
    path = Path(path)
    for rel, meta in manifest["files"].items():
        if rel.endswith(".safetensors"):
            yield {k: v.float() for k, v in read_tensors(path, rel, meta).items()
                   if not k.endswith((".exp_avg", ".exp_avg_sq", ".step"))}


def export_weights(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write checkpoint ``path``'s fp32 weights as one plain safetensors state dict (``GPT.state_dict()``
    keys; tied weights under both names; a GPT's LoRA adapters merged into their weights) with the
    model config as JSON metadata; or a ``torch.save`` state dict when ``out`` ends in ``.pt``.
    Loadable with ``GPT(GPTConfig(**config))`` and ``load_state_dict`` without pystronghold's
    runtime. Returns ``out``."""
    path, out = Path(path), Path(out)
    manifest = read_manifest(path)
    weights: dict[str, torch.Tensor] = {}
    for part in checkpoint_weights(path, manifest):
        weights.update(part)
    lora = (manifest.get("finetune") or {}).get("lora")
    if lora and manifest.get("base") is None:  # the checkpoint holds the frozen base too: a GPT's
        weights = merged_state_dict(weights, LoraSpec.from_record(lora), GPT_ARCHITECTURE)
    if manifest["model"].get("tie_embeddings") and "tail.lm_head.weight" not in weights:
        weights["tail.lm_head.weight"] = weights["head.tok.weight"].clone()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".pt":
        torch.save({"config": manifest["model"], "state_dict": weights}, out)
    else:
        save_safetensors(weights, out, metadata={"config": json.dumps(manifest["model"]),
                                                 "step": str(manifest["step"])})
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, leaving ``path`` with the permissions of any new file (the
    umask's: 0644 under 022) rather than save_file's 0600 (it writes a private temporary file)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0o077)  # NOTE: read by setting it; the strictest meanwhile, for other threads' files
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
