"""The store: every block's parameters and optimizer state as flat per-block buffers.

Per state there is one host arena (one allocation, pinned on CUDA hosts) carved into one flat
buffer per block held in host memory; with an NVMe directory, states that do not fit the host
budget live in the file tier instead (``placement.py`` decides, ``disk_tier.py`` stages them
through a bounded host cache). The states are:

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

from pystronghold.runtime.disk_tier import DiskTier, Lease
from pystronghold.runtime.placement import Placement, buffer_bytes, plan_placement, state_dtype

__all__ = ["ALIGN_ELEMS", "ParamSpan", "BlockLayout", "HostStore", "Lease", "available_host_bytes",
           "default_host_budget_bytes"]

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


DEFAULT_HOST_FRACTION = 0.85
"""Share of the available host memory the store may use when no budget is given: the rest is left
for activations, the loss, Python and torch (a store filled to the last byte would be OOM-killed)."""


def default_host_budget_bytes() -> int:
    """The host budget of a store when ``host_memory_bytes`` is not given, in bytes."""
    return int(available_host_bytes() * DEFAULT_HOST_FRACTION)


class HostStore:
    """Owns every block's states: host buffers per tier and, per ``placement``, the file tier.

    Host-memory states are flat buffers from one arena per state (``tiers[state][block]``; None for
    a block whose state is on disk). Every user goes through ``acquire``/``release`` leases, which
    hand out the host buffer directly or stage a disk state in the tier's cache
    (``pystronghold.runtime.disk_tier``). ``arena_factory(capacity_bytes)`` makes a HostArena.
    The caller planned the placement against its budget first: this class allocates.
    """

    def __init__(self, layouts: list[BlockLayout], compute_dtype: torch.dtype, arena_factory, *,
                 placement: Placement | None = None, disk_factory=None) -> None:
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        numels = [lay.numel for lay in layouts]
        if placement is None:
            placement = plan_placement(numels, compute_dtype, budget_bytes=2**62)
        self.placement = placement
        self.arenas = {}
        self.tiers: dict[str, list[torch.Tensor | None]] = {}
        for state in placement.states:
            in_ram = [b for b in range(len(layouts)) if not placement.on_disk(state, b)]
            bufs: list[torch.Tensor | None] = [None] * len(layouts)
            if in_ram:
                arena = arena_factory(sum(buffer_bytes(numels[b], state, compute_dtype) for b in in_ram)
                                      + _ARENA_ALIGN)
                self.arenas[state] = arena
                for b in in_ram:
                    bufs[b] = arena.allocate(f"{state}.{b}", (numels[b],), state_dtype(state, compute_dtype))
                    bufs[b].zero_()
            self.tiers[state] = bufs
        # NOTE: the tier is built last, so a failure above leaves no files behind
        self.disk: DiskTier | None = disk_factory(placement, numels) if placement.spilled else None
        if self.disk is not None:
            self.arenas["cache"] = self.disk.arena
        self.nbytes = sum(a.capacity_bytes for a in self.arenas.values())
        log.info("host store: %d blocks, %.1f MiB in host memory over %d arenas; %s", len(layouts),
                 self.nbytes / 2**20, len(self.arenas), placement.describe(len(layouts)))

    @property
    def has_shadow(self) -> bool:
        """True when a compute-precision shadow tier exists (bf16/fp16)."""
        return "shadow" in self.tiers

    @property
    def upload_state(self) -> str:
        """The state a load copies to the device: the shadow in bf16/fp16, the master in fp32."""
        return "shadow" if self.has_shadow else "master"

    def on_disk(self, state: str, block: int) -> bool:
        """True when ``state`` of ``block`` lives in the file tier."""
        return self.placement.on_disk(state, block)

    # ---- leases

    def acquire(self, block: int, states, *, fresh=(), modify=()) -> Lease:
        """Buffers of ``states`` of ``block`` (see ``DiskTier.acquire``): host buffers directly,
        disk states staged in the cache (call ``lease.wait()`` before reading them)."""
        ram = {s: self.tiers[s][block] for s in states if self.tiers[s][block] is not None}
        disk = [s for s in states if s not in ram]
        if not disk:
            return Lease(block, ram)
        lease = self.disk.acquire(block, disk, fresh=[s for s in fresh if s in disk],
                                  modify=[s for s in modify if s in disk])
        lease.tensors.update(ram)
        return lease

    def release(self, lease: Lease, *, dirty=(), after=(), drop=()) -> None:
        """Give ``lease`` back: its changed (``dirty``) disk states are written back behind the
        copies in ``after``; ``drop`` states are forgotten by the cache."""
        if lease.slot is not None:
            self.disk.release(lease, dirty=[s for s in dirty if s in lease.disk_states], after=after,
                              drop=[s for s in drop if s in lease.disk_states])

    def prefetch(self, block: int, states) -> None:
        """Start reading the disk states among ``states`` of ``block`` (never blocks)."""
        disk = [s for s in states if self.tiers[s][block] is None]
        if disk:
            self.disk.prefetch(block, disk)

    # ---- whole values (checkpoints, tests, exports)

    @torch.no_grad()
    def fill_from(self, block: int, params: list[torch.Tensor]) -> None:
        """Copy a block's initial parameter values into its master (and shadow) buffers."""
        states = ["master", "shadow"] if self.has_shadow else ["master"]
        lease = self.acquire(block, states, fresh=states)
        master = lease.tensors["master"]
        master.zero_()
        for view, p in zip(self.layouts[block].views(master), params):
            view.copy_(p.detach())
        if self.has_shadow:
            lease.tensors["shadow"].copy_(master)
        self.release(lease, dirty=states)

    def read_state(self, block: int, state: str) -> torch.Tensor:
        """The flat value of ``state`` of ``block``: the host buffer itself, or a copy read from disk."""
        lease = self.acquire(block, [state])
        try:
            lease.wait()
            value = lease.tensors[state] if lease.slot is None else lease.tensors[state].clone()
        finally:
            self.release(lease)
        return value

    @torch.no_grad()
    def write_state(self, block: int, state: str, values: list[torch.Tensor]) -> None:
        """Overwrite ``state`` of ``block`` with one tensor per parameter (gaps stay zero)."""
        lease = self.acquire(block, [state], fresh=[state])
        flat = lease.tensors[state]
        # NOTE: values may be views of this very buffer (a state dict loaded back): copy, then zero
        # only the gaps
        for view, v in zip(self.layouts[block].views(flat), values):
            view.copy_(v)
        self.layouts[block].zero_gaps(flat)
        self.release(lease, dirty=[state])

    # ---- the file tier as a whole

    def synchronize(self) -> None:
        """Wait for the file tier's reads and writes in flight (raises its first failure)."""
        if self.disk is not None:
            self.disk.synchronize()

    def take_events(self) -> list:
        """File reads/writes issued since the last call, for the trace."""
        return self.disk.take_events() if self.disk is not None else []

    def disk_stats(self) -> dict | None:
        """The file tier's counters (None without one)."""
        return self.disk.stats() if self.disk is not None else None

    def close(self) -> None:
        """Finish the file tier's I/O and close its files."""
        if self.disk is not None:
            self.disk.close()
