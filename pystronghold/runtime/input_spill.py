"""Offloaded block inputs past host memory: the NVMe tier of the input offload.

At a million tokens an 8B model's saved block inputs are hundreds of GiB, more than host memory
holds. With ``nvme_dir`` set, ``SavedInputs`` keeps staged inputs in host memory up to
``InputSpill.host_budget_bytes`` and writes the rest, once their device-to-host copy is done, to
one file in a scratch directory of their own under ``nvme_dir`` (its host buffer is then given
up). Backward reads them back a few blocks ahead of their recompute, into host memory, before
the copy to the device. One worker thread does the file I/O in submission order, so a read always
follows the write of its bytes (the next pass reuses the file from offset 0).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pystronghold.io.scratch import ScratchDir
from pystronghold.runtime.memory.placement import available_host_bytes

__all__ = ["InputSpill", "INPUT_HOST_FRACTION", "SPILL_ALIGN"]

INPUT_HOST_FRACTION = 0.5
"""Share of the host memory available when the engine is built that staged block inputs may hold
before the rest goes to disk."""
SPILL_ALIGN = 4096
"""Each staged storage starts at a multiple of this many bytes in the file."""


class InputSpill:
    """The file (under ``nvme_dir``) that offloaded block inputs beyond ``host_budget_bytes`` go to.

    ``host_budget_bytes``: staged bytes host memory may hold (default ``INPUT_HOST_FRACTION`` of
    the available host memory now); the scratch directory is made on the first write."""

    def __init__(self, nvme_dir: str, host_budget_bytes: int | None = None) -> None:
        self.nvme_dir = nvme_dir
        self.host_budget_bytes = (int(INPUT_HOST_FRACTION * available_host_bytes()) if host_budget_bytes is None
                                  else host_budget_bytes)
        self.written_bytes = 0
        """Bytes written to the file since the engine was built."""
        self.read_bytes = 0
        """Bytes read back from it."""
        self._scratch: ScratchDir | None = None
        self._fd: int | None = None
        self._end = 0  # next free offset of the pass in progress
        self._io = ThreadPoolExecutor(1, thread_name_prefix="pystronghold-input-spill")

    @property
    def path(self) -> str | None:
        """The file, once made."""
        return None if self._scratch is None else os.path.join(self._scratch.path, "block-inputs.bin")

    def new_pass(self) -> None:
        """A pass begins: its writes start at offset 0 again (the worker's order keeps earlier I/O first)."""
        self._end = 0

    def write(self, host: torch.Tensor) -> tuple[int, Future]:
        """Queue ``host`` (a contiguous uint8 CPU tensor) for writing; returns (its offset in the
        file, the future of the write). ``host`` must stay alive until that future is done."""
        if self._fd is None:
            self._scratch = ScratchDir(self.nvme_dir, prefix="pystronghold-inputs-")
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as e:
                raise OSError(f"input offload: cannot create {self.path}: {e.strerror or e}") from None
        offset = self._end
        self._end += -(-host.nbytes // SPILL_ALIGN) * SPILL_ALIGN
        return offset, self._io.submit(self._pwrite, host, offset)

    def read(self, offset: int, nbytes: int, *, pin: bool) -> Future:
        """Queue a read of ``nbytes`` bytes at ``offset``; the future's result is a new uint8 CPU
        tensor (pinned when ``pin``)."""
        return self._io.submit(self._pread, offset, nbytes, pin)

    def _pwrite(self, host: torch.Tensor, offset: int) -> None:
        self.written_bytes += self._whole(lambda view, at: os.pwrite(self._fd, view, at), host, offset, "writing")

    def _pread(self, offset: int, nbytes: int, pin: bool) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.read_bytes += self._whole(lambda view, at: os.preadv(self._fd, [view], at), host, offset, "reading")
        return host

    def _whole(self, io, host: torch.Tensor, offset: int, verb: str) -> int:
        """``io(view, at)`` (a pwrite or preadv) over all of ``host``'s bytes from ``offset``, as many
        calls as it takes; OSError naming the file, size and offset. Returns the bytes moved."""
        view, done = memoryview(host.numpy()), 0
        while done < len(view):
            try:
                n = io(view[done:], offset + done)
            except OSError as e:
                raise OSError(f"input offload: {verb} {len(view):,} bytes at offset {offset:,} of {self.path}: "
                              f"{e.strerror or e}") from None
            if n <= 0:
                raise OSError(f"input offload: {verb} {len(view):,} bytes at offset {offset:,} of {self.path}: "
                              f"stopped at offset {offset + done:,}")
            done += n
        return done

    def close(self) -> None:
        """Finish the I/O in flight, close and remove the file."""
        self._io.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._scratch is not None:
            self._scratch.close()
