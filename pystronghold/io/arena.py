"""Host arena: one large aligned host allocation carved into named, aligned tensor views.

One allocation per tier (not one per tensor). When a CUDA device is usable the allocation is
pinned with `cudaHostRegister` (so copies to the device are true DMA); otherwise it is
page-aligned anonymous memory, `mlock`ed on request (a failed lock is logged as a warning with
the reason, never an error). A capacity larger than the host can give (MemAvailable, or the cgroup
limit) fails before anything is allocated. Views keep the allocation alive after the arena object
is dropped. Views read as zero: the allocation is fresh anonymous memory (zero pages), and no byte
is handed out twice.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Sequence

import torch

from pystronghold._ext import native

logger = logging.getLogger(__name__)

__all__ = ["HostArena"]


class HostArena:
    """capacity_bytes: total size in bytes. alignment: byte alignment of every view (a power of
    two; 4096 suits O_DIRECT). pin: 'auto' (cudaHostRegister when a CUDA device is usable),
    'cuda' (pin or raise) or 'none'. lock: mlock the pages (warning on failure)."""

    def __init__(self, capacity_bytes: int, *, alignment: int = 4096, pin: str = "auto", lock: bool = False) -> None:
        self._arena = native()._HostArena(int(capacity_bytes), int(alignment), str(pin), bool(lock))
        for reason in (self._arena.pin_warning, self._arena.lock_warning):
            if reason:
                logger.warning("HostArena: %s", reason)
                warnings.warn(f"HostArena: {reason}", RuntimeWarning, stacklevel=2)

    def allocate(self, name: str, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor view of `shape` and `dtype`, aligned to max(alignment, itemsize) bytes, carved from the
        arena (zero: nothing wrote it before). Raises RuntimeError with the numbers when it does not fit, and when
        `name` is taken."""
        shape = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"HostArena.allocate({name!r}): negative dimension in shape {shape}")
        itemsize = dtype.itemsize
        raw = self._arena.allocate(str(name), math.prod(shape) * itemsize, itemsize)
        return raw.view(dtype).view(shape)

    def views(self) -> dict[str, tuple[int, int]]:
        """{name: (offset in bytes from the arena's base, size in bytes)} of every view."""
        return dict(self._arena.views())

    @property
    def capacity_bytes(self) -> int:
        """Total bytes of the arena."""
        return self._arena.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes handed out so far, alignment padding included."""
        return self._arena.used_bytes

    @property
    def alignment(self) -> int:
        """Byte alignment of every view."""
        return self._arena.alignment

    @property
    def pinned(self) -> bool:
        """True when the memory is registered with CUDA (page-locked for DMA)."""
        return self._arena.pinned

    @property
    def locked(self) -> bool:
        """True when the memory is mlock'ed."""
        return self._arena.locked

    @property
    def base_address(self) -> int:
        """Address of the first byte (for diagnostics)."""
        return self._arena.base_address

    def __repr__(self) -> str:
        return (f"HostArena(capacity_bytes={self.capacity_bytes}, used_bytes={self.used_bytes}, "
                f"alignment={self.alignment}, pinned={self.pinned}, locked={self.locked})")
