"""Read a Hugging Face model directory's safetensors weights one tensor at a time.

``SafetensorsShards`` opens ``model.safetensors`` or the shards of ``model.safetensors.index.json``
(headers only), checks the index against them, and reads single tensors on demand; ``float_shape``
checks a tensor's shape and dtype from the header alone. ``close()`` after each block keeps the
resident size at one block's worth (handles reopen on demand).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["SafetensorsShards", "FLOAT_DTYPES"]

FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
"""safetensors dtype names of the weights we load (cast to fp32 for the fp32 masters); integer,
boolean and fp8 tensors (quantized checkpoints) are refused."""

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsShards:
    """The safetensors weights of directory ``directory``: names, shapes, dtypes, and single tensors,
    by the names they are stored under (``models.hf_convert`` maps them to the model's). Raises
    ValueError (one line, naming the file) for a directory without weights, a missing shard, or an
    index that names a tensor its shard does not hold.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ValueError(f"{index}: not a safetensors index (no weight_map: {e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_NAME).is_file():
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise ValueError(f"{self.directory}: no {SINGLE_NAME} or {INDEX_NAME} (weights are read "
                             "from safetensors files only)")
        for name in files:
            if not (self.directory / name).is_file():
                raise ValueError(f"{self.directory / name}: shard missing (named by {INDEX_NAME})")
        self._handles = {}
        held = {key: name for name in files for key in self._handle(name).keys()}
        if weight_map is None:
            weight_map = held
        for key, name in weight_map.items():
            if held.get(key) != name:
                raise ValueError(f"{self.directory / name}: has no tensor {key!r} (named by {INDEX_NAME})")
        self.weight_map: dict[str, str] = dict(weight_map)
        """Stored tensor name -> shard file name (relative to the directory)."""

    def file_of(self, key: str) -> Path:
        """The shard holding stored tensor ``key``."""
        return self.directory / self.weight_map[key]

    def float_shape(self, key: str) -> tuple[int, ...]:
        """The shape of stored tensor ``key`` from its shard's header (nothing is read); ValueError
        unless its dtype is a float one."""
        sl = self._handle(self.weight_map[key]).get_slice(key)
        dtype = sl.get_dtype()
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{self.file_of(key)}: tensor {key!r} has dtype {dtype}; only {', '.join(FLOAT_DTYPES)} "
                             "weights are loaded (quantized checkpoints are not supported)")
        return tuple(sl.get_shape())

    def read(self, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored tensor ``key`` from its shard, as a new host tensor in ``dtype``."""
        return self._handle(self.weight_map[key]).get_tensor(key).to(dtype)

    @property
    def open_files(self) -> list[str]:
        """Shards open (memory-mapped) now."""
        return sorted(self._handles)

    def close(self) -> None:
        """Close the shards (unmapping them); a later ``float_shape`` or ``read`` reopens what it needs."""
        self._handles.clear()

    def _handle(self, name: str):
        """The open ``safe_open`` handle of shard ``name`` (opened on first use)."""
        if name not in self._handles:
            try:
                self._handles[name] = safe_open(str(self.directory / name), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError for a bad header
                raise ValueError(f"{self.directory / name}: not a readable safetensors file ({e})") from None
        return self._handles[name]
