"""Where an engine's bytes are: the device window, resident blocks and head/tail, the host store by
tier, and the file tier. ``engine.memory_report()`` returns it, so callers read figures instead of
the engine's parts."""

from __future__ import annotations

import dataclasses

import torch

from pystronghold.runtime.memory.layout import head_tail_bytes

__all__ = ["EngineMemory", "measure_memory"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class EngineMemory:
    """An engine's memory, as allocated when it is asked (bytes, element counts)."""

    window_slots: int
    """W: streamed blocks on the device at once."""
    blocks: int
    """Blocks of the model (resident + streamed)."""
    resident_blocks: int
    """K: blocks kept on the device with a device AdamW."""
    streamed_blocks: int
    """Blocks that stream through the window."""
    device_window_bytes: int
    """Device arena planned for the W slots (parameters + gradients in compute precision); 0 when
    nothing streams."""
    device_arena_used_bytes: int
    """Bytes carved from the device arena so far."""
    device_resident_blocks_bytes: int
    """The K resident blocks on the device: parameters, gradients, fp32 masters, AdamW moments."""
    device_head_tail_bytes: int
    """Head and tail on the device: parameters, gradients, fp32 masters (bf16/fp16), AdamW moments;
    with ``head_tail_on_host`` parameters and gradients only."""
    host_head_tail_bytes: int
    """The host arena of the head and tail's masters, moments, gradient copies and shadows with
    ``head_tail_on_host``; 0 otherwise."""
    device_elements: int
    """Parameter elements of the resident blocks, head and tail (what stays on the device)."""
    streamed_block_elements: tuple[int, ...]
    """Elements of each streamed block's layout (padding included), block order."""
    host_store_bytes: int
    """The host store's allocation (the file tier's staging cache included)."""
    host_frozen_bytes: int
    """The part of the store holding frozen block parameters (compute dtype)."""
    host_tier_bytes: dict[str, int]
    """Host store bytes per state (master, exp_avg, exp_avg_sq, grad, shadow; ``cache``: the file
    tier's staging cache)."""
    host_arenas: int
    """Host arenas of the block states (the file tier's cache not counted)."""
    host_pinned: bool
    """Every host arena built so far is pinned (registered with CUDA)."""
    disk: dict | None
    """The file tier's counters (``directory``, ``file_bytes``, ``read_bytes``, ``write_bytes``,
    ``hits``, ``misses``), or None without one."""
    disk_placement: str
    """One line: which states are on disk (``placement.Placement.describe``)."""


def measure_memory(*, store, resident, backend, head_tail_params: list[torch.Tensor], dtype: torch.dtype,
                   window_slots: int, planned_arena_bytes: int, host_head_tail_bytes: int = 0) -> EngineMemory:
    """The ``EngineMemory`` of an engine's parts (``engine.memory_report()``); ``host_head_tail_bytes``
    > 0: head and tail train from host memory (their optimizer states are not on the device)."""
    streamed = len(store.layouts)
    return EngineMemory(
        window_slots=window_slots, blocks=resident.count + streamed, resident_blocks=resident.count,
        streamed_blocks=streamed, device_window_bytes=int(planned_arena_bytes),
        device_arena_used_bytes=int(backend.arena_used_bytes), device_resident_blocks_bytes=resident.nbytes,
        device_head_tail_bytes=head_tail_bytes(head_tail_params, dtype, on_host=host_head_tail_bytes > 0),
        host_head_tail_bytes=int(host_head_tail_bytes),
        device_elements=sum(p.numel() for p in [*resident.params, *head_tail_params]),
        streamed_block_elements=tuple(lay.numel for lay in store.layouts),
        host_store_bytes=store.nbytes, host_frozen_bytes=store.frozen_bytes(), host_tier_bytes=store.tier_bytes(),
        host_arenas=store.arena_count, host_pinned=store.pinned, disk=store.disk_stats(),
        disk_placement=store.placement.describe(streamed))
