"""The CPU backend: the "device" is a separate, budgeted host arena.

Copies between the store and the device arena go through the copy engine's worker threads, really
asynchronously (loads on queue 0, gradient copy-outs on queue 1, so the two directions overlap;
file-tier reads and writes on queues 2 and 3),
and compute waits on copy handles exactly where the CUDA backend makes its stream wait on events.
Compute itself runs synchronously on the calling thread, so a slot is free as soon as the host
returns from the block's compute and its gradient copy-out has finished.
"""

from __future__ import annotations

import math

import torch

from pystronghold.io import CopyEngine, HostArena
from pystronghold.runtime.memory.layout import ARENA_ALIGN
from pystronghold.runtime.tracing.timing import HostClock

__all__ = ["CPUBackend"]

_H2D_QUEUE = 0
_D2H_QUEUE = 1
_FILE_READ_QUEUE = 2
_FILE_WRITE_QUEUE = 3


class CPUBackend:
    """Device = host memory in its own HostArena of ``arena_bytes`` bytes; copies via CopyEngine.

    ``copies`` is that engine, read at each copy: a test may replace it with anything that has
    ``CopyEngine``'s ``copy``/``close`` and returns handles with ``CopyHandle``'s ``wait``, ``done``,
    ``nbytes``, ``start_s`` and ``end_s`` (e.g. a slow link, to show copies overlap compute).
    """

    name = "cpu"

    def __init__(self, arena_bytes: int, *, copy_threads: int = 2, chunk_bytes: int = 8 << 20) -> None:
        self.device = torch.device("cpu")
        self.arena = HostArena(int(arena_bytes), alignment=ARENA_ALIGN, pin="none")
        # file reads and writes (NVMe tier) get queues of their own, so a long disk read never
        # holds back a load queued behind it, and a load can name a read in after=
        self.copies = CopyEngine(threads=copy_threads, queues=4, chunk_bytes=chunk_bytes)
        self.clock = HostClock()  # compute runs on this thread; copy requests carry their own stamps

    # ---- memory

    def device_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``numel``-element tensor from the device arena."""
        return self.arena.allocate(name, (numel,), dtype)

    def host_arena(self, capacity_bytes: int) -> HostArena:
        """A host arena for one store tier."""
        return HostArena(int(capacity_bytes), alignment=ARENA_ALIGN, pin="none")

    @property
    def arena_capacity_bytes(self) -> int:
        return self.arena.capacity_bytes

    @property
    def arena_used_bytes(self) -> int:
        """Bytes carved from the device arena so far."""
        return self.arena.used_bytes

    def file_io(self):
        """(copy engine, read queue, write queue) for the file tier: this backend's own engine."""
        return self.copies, _FILE_READ_QUEUE, _FILE_WRITE_QUEUE

    # ---- copies and ordering

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after=(), *, timed: bool = False):
        """Asynchronous store -> device copy; returns its handle (always stamped: ``timed`` is
        accepted for the CUDA backend's interface)."""
        return self.copies.copy(dst, src, queue=_H2D_QUEUE, after=[h for h in after if h is not None])

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after=(), *, timed: bool = False):
        """Asynchronous device -> store copy; returns its handle (always stamped)."""
        return self.copies.copy(dst, src, queue=_D2H_QUEUE, after=[h for h in after if h is not None])

    def compute_wait(self, handle) -> None:
        """Block until ``handle`` is done: compute runs on this thread."""
        handle.wait()

    def compute_marker(self):
        """None: compute on the CPU backend has finished when the host call returned."""
        return None

    def poison(self, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` with NaN (strict mode)."""
        tensor.fill_(math.nan)

    def synchronize(self) -> None:
        """Nothing to do: compute is synchronous; copies are waited on through their handles."""

    def close(self) -> None:
        self.copies.close()
