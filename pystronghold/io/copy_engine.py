"""Asynchronous copies between buffers, served by the native copy engine's worker threads.

``CopyEngine.copy(dst, src)`` returns a ``CopyHandle`` at once; the bytes move in ``chunk_bytes``
chunks on the workers. Requests on one queue complete in order; ``after=`` handles must complete
first (their failure fails the request). ``wait()`` releases the GIL and raises ``CopyError``
naming the file or buffer, offset and size. Host<->device copies (CUDA builds) start after the
work queued on torch's current stream at ``copy()`` time; wait for the handle before using
``dst`` or writing ``src``. File copies go through ``pystronghold.io.FileStore``.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from pystronghold._ext import native

logger = logging.getLogger(__name__)

__all__ = ["CopyEngine", "CopyHandle", "CopyError"]


class CopyError(RuntimeError):
    """A copy request failed. Attributes: `errno` (0 when no system call failed), `path` (file or
    buffer), `offset` (bytes into `path`, -1 when unknown) and `nbytes` (size of the failed transfer
    in bytes, -1 when unknown)."""

    def __init__(self, message: str, errno: int = 0, path: str = "", offset: int = -1, nbytes: int = -1):
        super().__init__(message)
        self.errno = errno
        self.path = path
        self.offset = offset
        self.nbytes = nbytes


class CopyHandle:
    """One submitted request. `wait()` blocks until it is done; times are on `time.monotonic()`."""

    __slots__ = ("_req",)

    def __init__(self, req) -> None:
        self._req = req

    def wait(self, timeout_s: float | None = None) -> None:
        """Block (GIL released) until the request is done; raise its `CopyError` if it failed.

        timeout_s: seconds to wait at most (None: no limit); `TimeoutError` when it passes first.
        """
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 seconds or None, got {timeout_s}")
        if not self._req.wait(-1.0 if timeout_s is None else float(timeout_s)):
            raise TimeoutError(f"copy of {self.nbytes} bytes on queue {self.queue} not done after {timeout_s} s")
        error = self._req.error()
        if error is not None:
            raise CopyError(*error)

    def done(self) -> bool:
        """True once the request has finished, successfully or not (never blocks)."""
        return self._req.done()

    @property
    def failed(self) -> bool:
        """True when the request is done and failed (`wait()` would raise)."""
        return self._req.done() and self._req.error() is not None

    @property
    def nbytes(self) -> int:
        """Bytes the request moves."""
        return self._req.nbytes

    @property
    def queue(self) -> int:
        """The queue the request was submitted on."""
        return self._req.queue

    @property
    def start_s(self) -> float:
        """When a worker began the request, seconds on `time.monotonic()`; 0.0 before it starts."""
        return self._req.start_s

    @property
    def end_s(self) -> float:
        """When the request finished, seconds on `time.monotonic()`; 0.0 before it finishes."""
        return self._req.end_s

    def __repr__(self) -> str:
        state = "failed" if self.failed else ("done" if self.done() else "pending")
        return f"CopyHandle(nbytes={self.nbytes}, queue={self.queue}, {state})"


def native_requests(after: Sequence[CopyHandle]) -> list:
    """The native requests of ``after`` (handles, or one handle), for a native submit call of this
    package (``CopyEngine.copy``, ``FileStore`` reads and writes); TypeError for another item."""
    if isinstance(after, CopyHandle):
        after = (after,)
    out = []
    for handle in after:
        if not isinstance(handle, CopyHandle):
            raise TypeError(f"after: expected CopyHandle items, got {type(handle).__name__}")
        out.append(handle._req)
    return out


class CopyEngine:
    """Worker threads serving copy queues.

    threads: worker threads (>= 1). queues: independent FIFO queues (>= 1). chunk_bytes: bytes per
    chunk (>= 4096); a request of n bytes is cut into ceil(n / chunk_bytes) chunks that any worker
    may run. Use as a context manager, or call `close()`.
    """

    def __init__(self, threads: int = 2, queues: int = 4, chunk_bytes: int = 8 << 20) -> None:
        self._engine = native()._CopyEngine(int(threads), int(queues), int(chunk_bytes))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, queue: int = 0,
             after: Sequence[CopyHandle] = ()) -> CopyHandle:
        """Copy the bytes of `src` into `dst` asynchronously; return its handle at once.

        dst, src: contiguous tensors holding the same number of bytes (dtypes may differ), both on
        the CPU, or one on the CPU and one on a CUDA device (CUDA builds). queue: which queue
        (requests on one queue complete in order). after: handles that must complete first.
        A host<->device copy also starts after everything queued so far on torch's current stream
        of that device (e.g. the kernel that wrote `src`); until the handle is done, neither the
        caller's later work on that stream nor any other stream may read `dst` or write `src`.
        Raises RuntimeError when the engine is closed or the tensors do not qualify.
        """
        return CopyHandle(self._engine.copy(dst, src, int(queue), native_requests(after)))

    @property
    def native(self):
        """The native engine (``_C._CopyEngine``) whose workers run the requests: what a native
        submit call of another io class takes (``FileStore`` reads and writes)."""
        return self._engine

    def close(self, wait: bool = True) -> None:
        """Stop the engine. wait=True: every submitted request runs first. wait=False: requests not
        yet finished fail with a 'cancelled' CopyError (chunks already running finish). Idempotent."""
        self._engine.close(bool(wait))

    @property
    def closed(self) -> bool:
        """True once `close()` was called: new requests are refused."""
        return self._engine.closed

    @property
    def threads(self) -> int:
        """Worker threads."""
        return self._engine.threads

    @property
    def queues(self) -> int:
        """Number of queues."""
        return self._engine.queues

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk."""
        return self._engine.chunk_bytes

    def __enter__(self) -> "CopyEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=True)

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close(True)  # releases the GIL while the workers drain

    def __repr__(self) -> str:
        return (f"CopyEngine(threads={self.threads}, queues={self.queues}, chunk_bytes={self.chunk_bytes}"
                f"{', closed' if self.closed else ''})")
