"""The file tier: fixed-size records, one per (block, state), in preallocated files on NVMe.

A store is a directory with one file ``<state>.psr`` per state, each holding ``num_blocks``
records of ``record_bytes``. ``read``/``write`` are copy-engine requests returning a
``CopyHandle``; errors surface on ``wait()`` naming file, offset and size. Files start with a
checksummed header (another format is refused), are preallocated at ``create()`` (so a full disk
shows there), use ``O_DIRECT`` where supported, and every record carries a CRC32C verified on
read: corruption or a never-written record raises ``CopyError``. A read-only directory opens
read-only. Order reads after writes of the same record (one queue or ``after=``).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import torch

from pystronghold._ext import native
from pystronghold.io.copy_engine import CopyEngine, CopyHandle, native_requests

logger = logging.getLogger(__name__)

__all__ = ["FileStore", "FORMAT_VERSION", "SUFFIX"]

FORMAT_VERSION = 1
"""On-disk format version written in every file header (`csrc/file_store.h` has the layout)."""
SUFFIX = ".psr"
_ALIGN = 4096
_STATE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,63}$")


class FileStore:
    """Records of fixed size per (block, state) in files under one directory.

    Build it with `FileStore.create(...)` or `FileStore.open(...)`. All sizes are in bytes.
    """

    def __init__(self, directory: Path, files: dict, engine: CopyEngine) -> None:
        self._directory = directory
        self._files = files  # state -> native _RecordFile
        self._engine = engine
        for state, f in files.items():
            if not f.direct:
                logger.info("FileStore %s: %s", directory, f.direct_note)
            if f.read_only_reason:
                logger.warning("FileStore %s: state %r %s", directory, state, f.read_only_reason)

    @classmethod
    def create(cls, directory: str | os.PathLike, *, num_blocks: int, record_bytes: Mapping[str, int],
               engine: CopyEngine, segment_bytes: int = 8 << 20, direct: str = "auto",
               preallocate: bool = True) -> "FileStore":
        """Create the store: one file per state, none of which may exist yet.

        num_blocks: records per state. record_bytes: {state name: bytes per record}.
        segment_bytes: checksum segment and I/O chunk size (a multiple of 4096). direct: 'auto'
        (O_DIRECT where supported), 'always' or 'never'. preallocate: reserve the disk space now.
        On failure no new file is left behind; files created before the failing one are removed.
        """
        if not record_bytes:
            raise ValueError("FileStore.create: record_bytes must name at least one state")
        for state in record_bytes:
            if not _STATE_NAME.match(state):
                raise ValueError(f"FileStore.create: state name {state!r} must match {_STATE_NAME.pattern}")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files: dict = {}
        try:
            for state, nbytes in record_bytes.items():
                files[state] = native()._RecordFile.create(
                    str(directory / f"{state}{SUFFIX}"), int(num_blocks), int(nbytes), int(segment_bytes),
                    state, direct, bool(preallocate))
        except RuntimeError:
            for f in files.values():
                f.close()
                Path(f.path).unlink(missing_ok=True)
            raise
        return cls(directory, files, engine)

    @classmethod
    def open(cls, directory: str | os.PathLike, *, engine: CopyEngine, direct: str = "auto") -> "FileStore":
        """Open the store in `directory`: every `*.psr` file, layouts read from their headers."""
        directory = Path(directory)
        paths = sorted(directory.glob(f"*{SUFFIX}"))
        if not paths:
            raise FileNotFoundError(f"FileStore.open: no {SUFFIX} files in {directory}")
        files = {}
        for path in paths:
            f = native()._RecordFile.open(str(path), direct)
            if f.state != path.stem:
                raise RuntimeError(f"FileStore.open: {path} holds state {f.state!r}, not {path.stem!r}")
            files[f.state] = f
        blocks = {f.num_blocks for f in files.values()}
        if len(blocks) != 1:
            raise RuntimeError(f"FileStore.open: the files in {directory} disagree on num_blocks: {sorted(blocks)}")
        return cls(directory, files, engine)

    @staticmethod
    def file_bytes_for(num_blocks: int, record_bytes: int) -> int:
        """Bytes of one state's file holding ``num_blocks`` records of ``record_bytes`` bytes: a
        4096-byte header, then per record a 4096-byte meta and the payload rounded up to 4096
        (the layout of ``csrc/file_store.h``). What ``create`` preallocates."""
        return _ALIGN + int(num_blocks) * (_ALIGN + (int(record_bytes) + _ALIGN - 1) // _ALIGN * _ALIGN)

    def _file(self, state: str):
        try:
            return self._files[state]
        except KeyError:
            raise KeyError(f"FileStore: no state {state!r}; the store holds {sorted(self._files)}") from None

    def write(self, block: int, state: str, src: torch.Tensor, *, queue: int = 0,
              after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """Write `src` (contiguous cpu tensor of exactly record_bytes(state) bytes) as the record of
        (block, state), asynchronously on the store's engine; the handle fails with CopyError on an
        I/O error (ENOSPC, EIO...) naming file, offset and size."""
        req = self._file(state).write(self._engine.native, int(block), src, int(queue), native_requests(after))
        return CopyHandle(req)

    def read(self, block: int, state: str, dst: torch.Tensor, *, queue: int = 0,
             after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """Read the record of (block, state) into `dst` (contiguous cpu tensor of record_bytes(state)
        bytes); the handle fails with CopyError when the record was never written, its checksum
        does not match, or the read fails."""
        req = self._file(state).read(self._engine.native, int(block), dst, int(queue), native_requests(after))
        return CopyHandle(req)

    def flush(self) -> None:
        """Make every completed write durable (fsync of each file; the GIL is released)."""
        for f in self._files.values():
            f.flush()

    def close(self) -> None:
        """Refuse further requests; files close once their in-flight requests finish."""
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "FileStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def directory(self) -> Path:
        """The store's directory."""
        return self._directory

    @property
    def num_blocks(self) -> int:
        """Records per state."""
        return next(iter(self._files.values())).num_blocks

    @property
    def states(self) -> dict[str, int]:
        """{state name: record size in bytes}."""
        return {s: f.record_bytes for s, f in self._files.items()}

    def record_bytes(self, state: str) -> int:
        """Bytes of one record of `state`."""
        return self._file(state).record_bytes

    def path(self, state: str) -> Path:
        """The file holding `state`."""
        return Path(self._file(state).path)

    def direct_io(self, state: str) -> bool:
        """True when the file of `state` uses O_DIRECT."""
        return self._file(state).direct

    @property
    def read_only(self) -> bool:
        """True when some file could only be opened read-only."""
        return any(f.read_only_reason for f in self._files.values())

    def file_bytes(self) -> int:
        """Bytes of all files together (headers, record metas and padding included)."""
        return sum(f.file_bytes for f in self._files.values())

    def __repr__(self) -> str:
        return f"FileStore({str(self._directory)!r}, num_blocks={self.num_blocks}, states={self.states})"
