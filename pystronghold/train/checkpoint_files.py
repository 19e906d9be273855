"""The checkpoint format's files: what each holds under which key, written and fsynced, read back
against the manifest's sha256. ``checkpoint_save`` and ``checkpoint_load`` build on these; names,
manifests and the directory are ``checkpoint_dir.py``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from pystronghold.runtime.optimizer.divergence import nonfinite_entry
from pystronghold.train.checkpoint_dir import CheckpointError, UnusableCheckpoint

__all__ = ["BLOCK_STATES", "STATE_KEYS", "write_file", "fsync_dir", "read_tensors", "read_finite_tensors",
           "read_state", "tp_split", "model_record"]

BLOCK_STATES = (("master", ""), ("exp_avg", ".exp_avg"), ("exp_avg_sq", ".exp_avg_sq"))
"""``(store tier, suffix of its key)`` of what a block file holds per parameter."""

STATE_KEYS = {"engine": "engine", "scheduler": "scheduler", "optimizer": "hyper", "sampler": "sampler",
              "rng": "rng"}
"""The key in ``state.pt`` of each state object's ``state_dict()`` (beside ``step``), in the order
they are loaded."""


def write_file(path: Path, data: bytes) -> dict:
    """Write ``data`` to ``path`` and fsync it; returns its manifest entry (sha256 and size)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        e.filename = e.filename or str(path)  # a failed write or fsync names no file
        raise
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def fsync_dir(path: Path) -> None:
    """fsync directory ``path``, so the names of the files written into it last."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_verified(path: Path, rel: str, meta: dict) -> bytes:
    data = (path / rel).read_bytes()
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:  # changed since it was verified
        raise CheckpointError(f"checkpoint {path}: {rel} is corrupt (sha256 mismatch)")
    return data


def read_tensors(path: Path, rel: str, meta: dict) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file ``rel`` of checkpoint ``path``, its sha256 checked against
    ``meta`` (its manifest entry): CheckpointError when it changed."""
    return st_load(_read_verified(path, rel, meta))


def read_finite_tensors(path: Path, rel: str, meta: dict) -> dict[str, torch.Tensor]:
    """``read_tensors``, refusing (UnusableCheckpoint) values or moments that hold inf/NaN: whole
    checksums, yet no run can continue from them (they were written so)."""
    tensors = read_tensors(path, rel, meta)
    bad = nonfinite_entry(tensors)
    if bad is not None:
        raise UnusableCheckpoint(f"checkpoint {path}: {rel}: {bad}")
    return tensors


def read_state(path: Path, manifest: dict) -> dict:
    """The dict of checkpoint ``path``'s ``state.pt``, its sha256 checked."""
    data = _read_verified(path, "state.pt", manifest["files"]["state.pt"])
    return torch.load(io.BytesIO(data), weights_only=False)


def tp_split(param: torch.Tensor) -> tuple[int, int, int]:
    """``(dim, rank, size)`` of a tensor-parallel parameter; ``(0, 0, 1)`` for a whole one."""
    return getattr(param, "tp_split", (0, 0, 1))


def model_record(config) -> dict:
    """The model config as the manifest keeps it: ``tp_size`` 1 (the format holds whole tensors),
    without the run's ``mlp_tile_tokens`` (how the MLP runs, not what the weights are)."""
    model = dataclasses.asdict(dataclasses.replace(config, tp_size=1))
    model.pop("mlp_tile_tokens", None)
    return model
