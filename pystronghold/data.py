"""Byte-level language-model data that is always there: the Python standard library's own sources.

Tokens are bytes (vocabulary 256), read in sorted path order from the running Python's stdlib
``*.py`` files (or the files the user names) up to ``max_bytes``. The held-out ``split`` is
``"range"`` (the last ``val_fraction`` of the bytes) or ``"file"`` (whole files chosen by a hash of
their path). ``BatchSampler`` returns (B, T) ``x`` and ``y = x`` shifted by one from a seeded
permutation of windows; its ``state_dict()`` makes a resumed run see the same batches. The stream
may also be int64 token ids or a numpy array (a token file's memory map), optionally with
``labels`` (``IGNORE_INDEX`` where no loss is taken).
"""

from __future__ import annotations

import logging
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["DataConfig", "Corpus", "load_corpus", "split_range", "default_paths", "BatchSampler", "validation_batches",
           "VOCAB_SIZE", "IGNORE_INDEX", "SKIP_DIRS"]

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte-level vocabulary."""
IGNORE_INDEX = -100
"""A target no loss is taken on (``cross_entropy``'s default ``ignore_index``)."""
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directories never read inside a data directory: installed packages and bytecode."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the text comes from and how it is split. Validated on construction."""

    paths: list[str] = field(default_factory=list)
    """Text files and directories to read; empty: the Python standard library's sources."""
    suffixes: tuple[str, ...] = (".py",)
    """File name endings read inside directories (files named directly are always read); empty:
    every file."""
    max_bytes: int = 8 << 20
    """Most bytes read (training and validation together), bytes."""
    val_fraction: float = 0.05
    """Share of the corpus held out for validation, in (0, 1)."""
    split: str = "range"
    """"range": the last val_fraction of the bytes; "file": whole files chosen by a hash of their path."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_bytes, int) or self.max_bytes < 2:
            raise ValueError(f"DataConfig.max_bytes must be an int >= 2, got {self.max_bytes!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"DataConfig.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.split not in ("range", "file"):
            raise ValueError(f"DataConfig.split must be 'range' or 'file', got {self.split!r}")
        for p in self.paths:
            if not os.path.exists(p):
                raise FileNotFoundError(f"DataConfig.paths: no such file or directory: {p}")


@dataclass(slots=True)
class Corpus:
    """Training and validation bytes (or token ids), and the files they came from."""

    train: torch.Tensor | np.ndarray
    """(N_train,) uint8 bytes, int64 token ids, or a token file's numpy memory map."""
    val: torch.Tensor | np.ndarray
    """(N_val,) as ``train``."""
    train_files: list[str]
    """Files (or parts of files) in the training bytes, in order."""
    val_files: list[str]
    """Files in the validation bytes ("range" split: the files the held-out range overlaps)."""
    train_labels: torch.Tensor | None = None
    """(N_train,) int64 targets, ``IGNORE_INDEX`` where no loss is taken; None: every token is a target."""
    val_labels: torch.Tensor | None = None
    """(N_val,) as ``train_labels``."""
    unit: str = "byte"
    """What one position of the stream is: "byte" (byte-level text) or "token" (a tokenizer's or a
    token file's ids); losses are nats per this unit."""


def default_paths() -> list[str]:
    """The standard library directory of the running Python."""
    return [sysconfig.get_paths()["stdlib"]]


def _walk(root: Path, suffixes: tuple[str, ...]):
    """Files under ``root`` in sorted order (depth first), or ``root`` itself when it is a file."""
    if root.is_file():
        yield root, root.name
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not suffixes or name.endswith(suffixes):
                path = Path(dirpath, name)
                yield path, str(path.relative_to(root))


def _is_val_file(rel: str, fraction: float) -> bool:
    return zlib.crc32(rel.encode()) / 2**32 < fraction


def load_corpus(config: DataConfig) -> Corpus:
    """Read the corpus of ``config`` (at most ``max_bytes`` bytes) and split it."""
    roots = [Path(p) for p in (config.paths or default_paths())]
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(f"data path does not exist: {root}")
    budget = {"train": config.max_bytes, "val": 0}  # "range": one stream, cut afterwards
    if config.split == "file":
        budget["val"] = max(1, int(config.max_bytes * config.val_fraction))
        budget["train"] = config.max_bytes - budget["val"]
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    files: dict[str, list[str]] = {"train": [], "val": []}
    used = {"train": 0, "val": 0}
    offsets: list[tuple[int, str]] = []  # (start byte, file) of the single stream ("range" split)
    for root in roots:
        for path, rel in _walk(root, config.suffixes):
            part = "val" if config.split == "file" and _is_val_file(rel, config.val_fraction) else "train"
            room = budget[part] - used[part]
            if room <= 0:
                if all(used[k] >= budget[k] for k in used):
                    break
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read(room - 1) + b"\n"  # never more than the budget left
            except OSError as e:
                raise OSError(f"cannot read data file {path}: {e}") from e
            offsets.append((used[part], str(path)))
            parts[part].append(data)
            files[part].append(str(path))
            used[part] += len(data)
    stream = {k: torch.frombuffer(bytearray(b"".join(v)), dtype=torch.uint8) if v else
              torch.empty(0, dtype=torch.uint8) for k, v in parts.items()}
    if config.split == "range":
        full = stream["train"]
        n_val = int(len(full) * config.val_fraction)
        cut = len(full) - n_val
        stream = {"train": full[:cut], "val": full[cut:]}
        files = {"train": [f for start, f in offsets if start < cut],
                 "val": [f for i, (start, f) in enumerate(offsets)
                         if (offsets[i + 1][0] if i + 1 < len(offsets) else len(full)) > cut]}
    for part in ("train", "val"):
        if len(stream[part]) < 2:
            raise ValueError(f"the {part} split of {', '.join(map(str, roots))} has {len(stream[part])} "
                             f"bytes (files: {len(files[part])}); give more text, a larger max_bytes or "
                             f"val_fraction, or split='range'")
    full = all(used[k] >= budget[k] for k in used)
    log.info("corpus: %d train bytes (%d files), %d validation bytes (%d files), split=%s%s",
             len(stream["train"]), len(files["train"]), len(stream["val"]), len(files["val"]), config.split,
             f"; max_bytes {config.max_bytes} reached, the rest is not read" if full else "")
    return Corpus(train=stream["train"], val=stream["val"], train_files=files["train"],
                  val_files=files["val"])


def split_range(stream, val_fraction: float, *, remedy: str, where: str = ""):
    """``(train, val)`` views of ``stream``: the last ``val_fraction`` of it is validation.
    ValueError (``where``, the short split, ``remedy``) when either has fewer than 2 tokens."""
    cut = len(stream) - int(len(stream) * val_fraction)
    train, val = stream[:cut], stream[cut:]
    for part, t in (("train", train), ("val", val)):
        if len(t) < 2:
            raise ValueError(f"{where}the {part} split has {len(t)} tokens; {remedy}")
    return train, val

def _check_stream(data, labels, who: str) -> None:
    if isinstance(data, np.ndarray):
        if data.ndim != 1 or data.dtype.kind not in "iu":
            raise ValueError(f"{who}: a numpy stream must be 1-D integer, got {data.dtype} {data.shape}")
    elif data.dim() != 1 or data.dtype not in (torch.uint8, torch.int64):
        raise ValueError(f"{who}: data must be a 1-D uint8 (bytes) or int64 (token ids) tensor, "
                         f"got {data.dtype} {tuple(data.shape)}")
    if labels is not None and (labels.dtype != torch.int64 or labels.shape != (len(data),)):
        raise ValueError(f"{who}: labels must be int64 of the data's shape ({len(data)},), "
                         f"got {labels.dtype} {tuple(labels.shape)}")


def _windows(data, labels, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` (B, T) int64 of the windows ``idx`` (B, T + 1): y is x shifted by one, or the
    labels at the same positions."""
    if isinstance(data, np.ndarray):  # a memory map: only these windows' pages are read
        w = torch.from_numpy(data[idx.numpy()].astype(np.int64))
    else:
        w = data[idx].long()  # (B, T + 1)
    return w[:, :-1], (w if labels is None else labels[idx])[:, 1:]


class BatchSampler:
    """Deterministic, resumable (B, T) batches of next-token prediction from a uint8 stream of bytes
    (or int64 token ids, ``pystronghold.tokenized``, or a numpy memory map; optional ``labels``:
    see the module docstring)."""

    def __init__(self, data: torch.Tensor | np.ndarray, batch: int, seq: int, seed: int = 0, *,
                 labels: torch.Tensor | None = None) -> None:
        _check_stream(data, labels, "BatchSampler")
        if batch < 1 or seq < 1:
            raise ValueError(f"BatchSampler: batch and seq must be >= 1, got {batch}, {seq}")
        if len(data) < 2 * (seq + 1):
            raise ValueError(f"BatchSampler: {len(data)} bytes are too few for windows of {seq + 1} "
                             f"bytes (need at least {2 * (seq + 1)})")
        self.data, self.labels, self.batch, self.seq, self.seed = data, labels, batch, seq, seed
        self.epoch, self.position = 0, 0
        self._starts = self._epoch_starts(0)

    def _epoch_starts(self, epoch: int) -> torch.Tensor:
        """Window starts of ``epoch`` in visiting order, (n_windows,) int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        offset = int(torch.randint(0, self.seq + 1, (1,), generator=g))
        n = (len(self.data) - offset) // (self.seq + 1)
        return offset + torch.randperm(n, generator=g) * (self.seq + 1)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, each (B, T) int64; y is x shifted by one (or the labels there)."""
        starts = []
        while len(starts) < self.batch:
            if self.position == len(self._starts):
                self.epoch, self.position = self.epoch + 1, 0
                self._starts = self._epoch_starts(self.epoch)
            take = min(self.batch - len(starts), len(self._starts) - self.position)
            starts += self._starts[self.position:self.position + take].tolist()
            self.position += take
        idx = torch.tensor(starts)[:, None] + torch.arange(self.seq + 1)  # (B, T + 1)
        return _windows(self.data, self.labels, idx)

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The data position: seed, epoch and index into the epoch's permutation (plus the shape,
        checked on load)."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch": self.batch, "seq": self.seq, "data_bytes": len(self.data)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; ValueError if it was saved for other data or shapes."""
        mine = {"batch": self.batch, "seq": self.seq, "data_bytes": len(self.data)}
        theirs = {k: state.get(k) for k in mine}
        if mine != theirs:
            raise ValueError(f"BatchSampler.load_state_dict: saved for {theirs}, this sampler has {mine}")
        self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), int(state["position"])
        self._starts = self._epoch_starts(self.epoch)
        if not 0 <= self.position <= len(self._starts):
            raise ValueError(f"BatchSampler.load_state_dict: position {self.position} outside the "
                             f"epoch's {len(self._starts)} windows")


def validation_batches(data: torch.Tensor | np.ndarray, batch: int, seq: int, n_batches: int, *,
                       labels: torch.Tensor | None = None):
    """A fixed list of ``n_batches`` (x, y) batches, (B, T) int64 each, from windows spread evenly
    over ``data`` (the same every call: validation losses are comparable across steps); ``data``
    and ``labels`` as ``BatchSampler`` takes them."""
    _check_stream(data, labels, "validation_batches")
    n_windows = (len(data) - 1) // (seq + 1)
    if n_windows < 1:
        raise ValueError(f"validation_batches: {len(data)} bytes hold no window of {seq + 1} bytes")
    count = min(n_windows, batch * n_batches)
    batch = min(batch, count)  # a short validation split gives smaller batches, never none
    starts = torch.linspace(0, len(data) - seq - 1, count).long()  # (count,)
    out = []
    for i in range(0, count - batch + 1, batch):
        idx = starts[i:i + batch, None] + torch.arange(seq + 1)  # (B, T + 1)
        out.append(_windows(data, labels, idx))
    return out
