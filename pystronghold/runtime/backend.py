"""What a backend does for the engine, and how one is chosen.

The engine never copies or synchronises by itself: it asks its backend, which provides
``device``, ``device_buffer`` (from the budgeted device arena), ``host_arena``, asynchronous
``h2d``/``d2h`` copies ordered ``after`` other handles (handles with ``wait()``/``done()``),
``clock`` (trace marks, ``runtime/tracing/timing.py``), ``compute_wait`` and ``compute_marker`` (order
compute and copies; the host blocks only on the CPU backend), ``poison`` (NaN fill, strict mode),
arena byte counts, ``synchronize()`` and ``close()``.
"""

from __future__ import annotations

__all__ = ["make_backend"]


def make_backend(device: str, arena_bytes: int, *, copy_threads: int = 2, chunk_bytes: int = 8 << 20):
    """The backend for ``device`` ("cpu" or "cuda[:n]") with a device arena of ``arena_bytes`` bytes."""
    if device == "cpu":
        from pystronghold.runtime.backends.backend_cpu import CPUBackend

        return CPUBackend(arena_bytes, copy_threads=copy_threads, chunk_bytes=chunk_bytes)
    if device.startswith("cuda"):
        from pystronghold.runtime.backends.backend_cuda import CUDABackend

        return CUDABackend(device, arena_bytes, copy_threads=copy_threads, chunk_bytes=chunk_bytes)
    raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {device!r}")
