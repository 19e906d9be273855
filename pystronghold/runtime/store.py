"""The host store: every block's parameters and optimizer state as flat per-block host buffers.

Per tier there is one host arena (one allocation, pinned on CUDA hosts) carved into one flat buffer
per block. The tiers are:

=============  ==============  ====================================================================
tier           dtype           what it holds
=============  ==============  ====================================================================
master         fp32            the parameters the optimizer updates (the source of truth)
exp_avg        fp32            Adam first moment
exp_avg_sq     fp32            Adam second moment
grad           compute dtype   the block's gradient as it left the device
shadow         compute dtype   bf16/fp16 copy of master that the next forward uploads (not in fp32)
=============  ==============  ====================================================================

Inside a block's buffer, parameter k occupies ``[offset_k, offset_k + numel_k)``; offsets are
aligned to ``ALIGN_ELEMS`` elements. The gaps between parameters are zero in every tier, so the
fused Adam can run over the whole flat buffer without touching real values.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

__all__ = ["ALIGN_ELEMS", "ParamSpan", "BlockLayout", "HostStore", "available_host_bytes",
           "store_bytes"]

log = logging.getLogger(__name__)

ALIGN_ELEMS = 16
"""Parameter offsets inside a block buffer are multiples of this many elements (64 bytes in fp32)."""
_ARENA_ALIGN = 4096


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True, slots=True)
class ParamSpan:
    """Where one parameter lives inside its block's flat buffer (in elements)."""

    name: str
    """Name relative to the block, e.g. ``attn.qkv.weight``."""
    shape: torch.Size
    offset: int
    numel: int


class BlockLayout:
    """Offsets of a block's parameters in its flat buffers; ``numel`` is the padded total."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        self.spans: list[ParamSpan] = []
        offset = 0
        for name, p in named_params:
            offset = _round_up(offset, ALIGN_ELEMS)
            self.spans.append(ParamSpan(name, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel = max(_round_up(offset, ALIGN_ELEMS), ALIGN_ELEMS)
        # Ranges not covered by any parameter: kept at zero wherever a flat buffer is written.
        self.gaps: list[tuple[int, int]] = []
        end = 0
        for s in self.spans:
            if s.offset > end:
                self.gaps.append((end, s.offset))
            end = s.offset + s.numel
        if self.numel > end:
            self.gaps.append((end, self.numel))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter (in the parameter's shape) into ``flat`` (>= numel elements)."""
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.spans]

    def zero_gaps(self, flat: torch.Tensor) -> None:
        """Write zeros into the padding of ``flat``."""
        for start, end in self.gaps:
            flat[start:end].zero_()


def available_host_bytes() -> int:
    """Host memory the store may use, in bytes: MemAvailable from /proc/meminfo (Linux), else all RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def store_bytes(layouts: list[BlockLayout], compute_dtype: torch.dtype) -> dict[str, int]:
    """Bytes each tier's arena needs (per-block buffers aligned to 4096 bytes)."""
    half = compute_dtype != torch.float32
    itemsize = {"master": 4, "exp_avg": 4, "exp_avg_sq": 4,
                "grad": torch.finfo(compute_dtype).bits // 8}
    if half:
        itemsize["shadow"] = torch.finfo(compute_dtype).bits // 8
    return {tier: sum(_round_up(lay.numel * size, _ARENA_ALIGN) for lay in layouts) + _ARENA_ALIGN
            for tier, size in itemsize.items()}


class HostStore:
    """Allocates and owns the per-block host buffers of every tier.

    ``arena_factory(capacity_bytes)`` makes one HostArena per tier. The caller checks the budget
    first (``prepare.check_host_memory``): this class allocates.
    """

    def __init__(self, layouts: list[BlockLayout], compute_dtype: torch.dtype, arena_factory) -> None:
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        need = store_bytes(layouts, compute_dtype)
        total = sum(need.values())
        self.nbytes = total
        self.arenas = {tier: arena_factory(cap) for tier, cap in need.items()}
        dtypes = {"master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32,
                  "grad": compute_dtype, "shadow": compute_dtype}
        self.tiers: dict[str, list[torch.Tensor]] = {}
        for tier, arena in self.arenas.items():
            bufs = []
            for i, lay in enumerate(layouts):
                buf = arena.allocate(f"{tier}.{i}", (lay.numel,), dtypes[tier])
                buf.zero_()
                bufs.append(buf)
            self.tiers[tier] = bufs
        log.info("host store: %d blocks, %.1f MiB over %d tiers", len(layouts), total / 2**20, len(need))

    @property
    def has_shadow(self) -> bool:
        """True when a compute-precision shadow tier exists (bf16/fp16)."""
        return "shadow" in self.tiers

    def upload_source(self, block: int) -> torch.Tensor:
        """The host buffer a load copies from: the shadow in bf16/fp16, the master in fp32."""
        return self.tiers["shadow" if self.has_shadow else "master"][block]

    @torch.no_grad()
    def fill_from(self, block: int, params: list[torch.Tensor]) -> None:
        """Copy a block's initial parameter values into its master (and shadow) buffers."""
        for view, p in zip(self.layouts[block].views(self.tiers["master"][block]), params):
            view.copy_(p.detach())
        if self.has_shadow:
            self.tiers["shadow"][block].copy_(self.tiers["master"][block])

    def master_views(self, block: int) -> list[torch.Tensor]:
        """fp32 master value of each parameter of ``block`` (views into the store)."""
        return self.layouts[block].views(self.tiers["master"][block])
