"""What a backend does for the engine, and how one is chosen.

The engine never copies or synchronises by itself: it asks its backend. A backend provides

- ``device``: where compute runs (head, tail and the window slots live there);
- ``device_buffer(name, numel, dtype)``: a flat tensor carved from the budgeted device arena;
- ``host_arena(capacity_bytes)``: a host arena for one store tier (pinned where that helps);
- ``h2d(dst, src, after, timed=)`` / ``d2h(dst, src, after, timed=)``: an asynchronous copy that
  starts after the handles in ``after`` and returns a handle with ``wait()``, ``done()``, ``nbytes``
  and, once done, its start and end marks (``runtime.timing.copy_marks``: host stamps on the CPU,
  events on CUDA only when ``timed``);
- ``clock``: makes the trace's marks (``HostClock`` on the CPU, ``EventClock`` on CUDA: timing
  events on the compute stream) and the per-step calibration that places device marks on the host
  clock (``runtime/timing.py``);
- ``compute_wait(handle)``: make the following compute wait for a copy (CPU: block on the handle;
  CUDA: the compute stream waits on the copy's event, the host does not block);
- ``compute_marker()``: a handle that completes when the compute issued so far has finished
  (CPU: None, compute is synchronous; CUDA: an event on the compute stream);
- ``poison(tensor)``: fill with NaN (strict mode), ordered after the compute issued so far;
- ``arena_peak_bytes`` / ``arena_capacity_bytes``; ``synchronize()``; ``close()``.
"""

from __future__ import annotations

__all__ = ["make_backend"]


def make_backend(device: str, arena_bytes: int, *, copy_threads: int = 2, chunk_bytes: int = 8 << 20):
    """The backend for ``device`` ("cpu" or "cuda[:n]") with a device arena of ``arena_bytes`` bytes."""
    if device == "cpu":
        from pystronghold.runtime.backend_cpu import CPUBackend

        return CPUBackend(arena_bytes, copy_threads=copy_threads, chunk_bytes=chunk_bytes)
    if device.startswith("cuda"):
        from pystronghold.runtime.backend_cuda import CUDABackend

        return CUDABackend(device, arena_bytes, copy_threads=copy_threads, chunk_bytes=chunk_bytes)
    raise ValueError(f"device must be 'cpu' or 'cuda[:n]', got {device!r}")
