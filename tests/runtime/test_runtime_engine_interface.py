"""The Engine's interface: its parts (store, window, plans, executor, step, host updates) are private,
and ``memory_report()`` gives their bytes, the same figures ``stats()`` and the parts hold."""

from __future__ import annotations

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.engine import engine_parts_for_tests
from pystronghold.runtime.memory.layout import head_tail_bytes
from runtime_models import engine_steps, gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)

PARTS = ("store", "window", "plans", "executor", "stepper", "updates")


def test_the_engine_keeps_its_parts_private():
    engine = ph.wrap(tiny_gpt(layers=3), window=1)
    try:
        assert [name for name in PARTS if hasattr(engine, name)] == []
        assert set(engine_parts_for_tests(engine)) == set(PARTS)
    finally:
        engine.close()


@pytest.mark.parametrize("nvme", [False, True])
def test_memory_report_gives_the_stores_and_the_devices_bytes(tmp_path, nvme):
    """Figures read from the parts themselves: the store's allocation and tiers, each streamed block's
    padded layout, the arena and the resident/head/tail bytes, and the file tier's counters."""
    model = tiny_gpt(layers=4)
    options = dict(nvme_dir=str(tmp_path / "nvme"), nvme_states="all", nvme_cache_blocks=2) if nvme else {}
    engine = ph.wrap(model, window=2, resident_blocks=1, **options)
    try:
        engine_steps(engine, gpt_batches(1))
        memory, store = engine.memory_report(), engine_parts_for_tests(engine)["store"]
        assert (memory.window_slots, memory.blocks, memory.resident_blocks, memory.streamed_blocks) == (2, 4, 1, 3)
        assert memory.streamed_block_elements == tuple(lay.numel for lay in store.layouts)
        assert memory.host_store_bytes == store.nbytes and memory.host_tier_bytes == store.tier_bytes()
        assert memory.host_arenas == sum(len(a) for a in store.arenas.values())
        # W slots of fp32 parameters and gradients
        assert memory.device_window_bytes == engine.planned_arena_bytes >= 2 * max(memory.streamed_block_elements) * 8
        assert memory.device_head_tail_bytes == head_tail_bytes(engine.head_tail_params, torch.float32)
        assert memory.device_elements == sum(p.numel() for p in model.blocks[0].parameters()) + sum(
            p.numel() for p in engine.head_tail_params)
        stats = engine.stats()
        assert (stats["store_bytes"], stats["resident_bytes"], stats["arena_used_bytes"], stats["disk"]) == (
            memory.host_store_bytes, memory.device_resident_blocks_bytes, memory.device_arena_used_bytes,
            memory.disk)
        assert (memory.disk is not None) == nvme and ("on disk" in memory.disk_placement) == nvme
        if nvme:
            assert memory.disk["read_bytes"] > 0 and "cache" in memory.host_tier_bytes
    finally:
        engine.close()
