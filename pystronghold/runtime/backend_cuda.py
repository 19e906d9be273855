"""The CUDA backend: window slots in device memory, copies on dedicated streams ordered by events.

Loads run on ``h2d_stream``, gradient copy-outs on ``d2h_stream``, compute on the current stream;
streams wait on events, never the host. A slot is reused only after its release and its gradient
copy-out. The store's arenas are pinned, so copies are asynchronous DMA. Host-waited events are
``blocking=True`` (the host sleeps instead of spinning). Timed copies (``timed=True``) are
bracketed by timing events placed on the host clock by ``runtime/tracing/timing.py``. Importable without
CUDA; constructing it without a GPU raises RuntimeError.
"""

from __future__ import annotations

import math

import torch

from pystronghold.io import HostArena
from pystronghold.runtime.memory.layout import ARENA_ALIGN
from pystronghold.runtime.tracing.timing import EventClock

__all__ = ["CUDABackend", "EventHandle"]

_DEVICE_ALIGN = 256  # bytes; cudaMalloc's own alignment


def _event(*, timing: bool = False):
    """A CUDA event the host can wait on without spinning (``blocking=True``)."""
    return torch.cuda.Event(enable_timing=timing, blocking=True)


class EventHandle:
    """A copy (or a compute point) on a CUDA stream: complete when its ``event`` has fired.

    A timed copy's handle carries its device marks, ``start_mark`` and ``end_mark`` (timing events
    recorded on the copy's stream just before and after it); an untimed copy and a compute marker
    have none (None).
    """

    def __init__(self, event, nbytes: int, keepalive=(), start_mark=None) -> None:
        self.event = event
        self.nbytes = nbytes
        self.start_mark = start_mark
        self.end_mark = event if start_mark is not None else None
        self._keepalive = keepalive  # tensors must outlive the copy
        self._done = False

    def done(self) -> bool:
        if not self._done and self.event.query():
            self._done = True
            self._keepalive = ()
        return self._done

    def wait(self, timeout_s: float | None = None) -> None:
        # NOTE: CUDA events have no timed wait; timeout_s is accepted for interface parity.
        self.event.synchronize()
        self.done()


class CUDABackend:
    """Slots in one device allocation of ``arena_bytes`` bytes; two copy streams; pinned host arenas."""

    name = "cuda"

    def __init__(self, device: str, arena_bytes: int, *, copy_threads: int = 2, chunk_bytes: int = 8 << 20) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for, but CUDA is not available in this "
                               f"torch build or on this machine (torch {torch.__version__}); use device='cpu'")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._arena = torch.empty(int(arena_bytes), dtype=torch.uint8, device=self.device)
        self._used = 0
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        # marks for the trace: timing events, on the compute stream unless a stream is named
        self.clock = EventClock(lambda: _event(timing=True),
                                lambda: torch.cuda.current_stream(self.device))
        self._file_engine = None

    # ---- memory

    def device_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat ``numel``-element tensor carved from the device arena (256-byte aligned)."""
        nbytes = numel * dtype.itemsize
        start = (self._used + _DEVICE_ALIGN - 1) // _DEVICE_ALIGN * _DEVICE_ALIGN
        if start + nbytes > self._arena.numel():
            raise MemoryError(f"device arena: {name!r} needs {nbytes:,} bytes at offset {start:,}, "
                              f"capacity is {self._arena.numel():,} bytes")
        self._used = start + nbytes
        return self._arena[start:start + nbytes].view(dtype)

    def host_arena(self, capacity_bytes: int) -> HostArena:
        """A pinned host arena for one store tier (or one chunk of it). Callable from any thread:
        the store's builder thread pins with this backend's device current, so no other device
        gets a CUDA context (the registration is portable to every device anyway)."""
        with torch.cuda.device(self.device):
            return HostArena(int(capacity_bytes), alignment=ARENA_ALIGN, pin="auto")

    @property
    def arena_capacity_bytes(self) -> int:
        return self._arena.numel()

    @property
    def arena_used_bytes(self) -> int:
        return self._used

    # ---- copies and ordering

    def file_io(self):
        """(copy engine, read queue, write queue) for the file tier: an engine of its own, made on
        first use (file I/O is host work; a copy from a buffer it fills waits for it on the host)."""
        if self._file_engine is None:
            from pystronghold.io import CopyEngine

            self._file_engine = CopyEngine(threads=2, queues=2)
        return self._file_engine, 0, 1

    def _copy(self, stream, dst: torch.Tensor, src: torch.Tensor, after, timed: bool) -> EventHandle:
        for h in after:
            if h is None:
                continue
            if isinstance(h, EventHandle):
                stream.wait_event(h.event)
            else:  # a host-side request (a file read): the host waits before issuing the copy
                h.wait()
        nbytes = dst.numel() * dst.element_size()
        with torch.cuda.stream(stream):
            if not timed:  # NOTE: one event without timing: recording and querying it is cheaper
                dst.copy_(src, non_blocking=True)
                end = _event()
                end.record(stream)
                return EventHandle(end, nbytes, (dst, src))
            start = self.clock.mark(stream)
            dst.copy_(src, non_blocking=True)
            end = self.clock.mark(stream)
        return EventHandle(end, nbytes, (dst, src), start_mark=start)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, after=(), *, timed: bool = False) -> EventHandle:
        """Store -> device copy on the load stream, after the events of ``after``; bracketed by
        timing events when ``timed``."""
        return self._copy(self.h2d_stream, dst, src, after, timed)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, after=(), *, timed: bool = False) -> EventHandle:
        """Device -> store copy on the copy-out stream, after the events of ``after``; bracketed by
        timing events when ``timed``."""
        return self._copy(self.d2h_stream, dst, src, after, timed)

    def compute_wait(self, handle: EventHandle) -> None:
        """The compute stream waits for ``handle``'s event; the host does not block."""
        torch.cuda.current_stream(self.device).wait_event(handle.event)

    def compute_marker(self) -> EventHandle:
        """An event after everything issued so far on the compute stream."""
        event = _event()  # ordering only: no timing
        event.record(torch.cuda.current_stream(self.device))
        return EventHandle(event, 0)

    def poison(self, tensor: torch.Tensor) -> None:
        """NaN-fill on the compute stream (ordered after the compute that used the slot)."""
        tensor.fill_(math.nan)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.synchronize()
        if self._file_engine is not None:
            self._file_engine.close()
