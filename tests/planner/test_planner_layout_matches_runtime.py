"""The planner's bytes are the runtime's: the window slot and head/tail it predicts for a model
are what ``wrap`` allocates for that model (both go through ``runtime/memory/layout.py``)."""

from __future__ import annotations

import pytest

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.planner import Hardware, Workload, block_costs, gpu_preset
from pystronghold.runtime.memory import layout
from pystronghold.runtime.memory.layout import head_tail_bytes
from runtime_models import one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_slot_and_head_tail_bytes_are_allocated_bytes(precision):
    # hidden 180: sizes that are not multiples of 16, so offsets get padding, and enough of it that
    # a slot counted without it would be 4096 bytes per buffer smaller in fp32 and in bf16
    cfg = GPTConfig(vocab_size=97, seq_len=16, layers=3, hidden=180, heads=4)
    hw = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 << 30, cpu_adam_params_per_s=1e9)
    costs = block_costs(cfg, Workload(batch=1, seq=16, precision=precision), hw)
    model = GPT(cfg)
    engine = ph.wrap(model, blocks=model.blocks, window=2, precision=precision)
    try:
        padded = list(engine.memory_report().streamed_block_elements)
        assert padded[0] > costs.block_params  # the padding is there ...
        assert engine.planned_arena_bytes == 2 * costs.slot_bytes  # ... and the planner counts it
        assert engine.backend.arena_used_bytes <= engine.planned_arena_bytes
        assert head_tail_bytes(engine.head_tail_params, engine.dtype) == costs.head_tail_bytes
        # every state's arena: one buffer per block, rounded, plus the arena's slack
        tiers = engine.memory_report().host_tier_bytes
        assert set(tiers) == set(layout.stored_states(engine.dtype))
        for state, nbytes in tiers.items():
            assert nbytes == layout.arena_bytes(sum(layout.buffer_bytes(n, state, engine.dtype) for n in padded))
            assert nbytes % layout.ARENA_ALIGN == 0
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_host_bytes_are_the_host_stores_bytes(precision):
    """The planner sizes the host store from the padded block layout, as ``HostStore`` does: its
    host bytes are the runtime placement's, and the store's arenas hold exactly those plus one
    alignment of slack each (the hidden-180 model's padding crosses a 4096-byte boundary, so
    unpadded counts would come out one page per buffer short)."""
    from pystronghold.planner.plan import make_plan

    cfg = GPTConfig(vocab_size=97, seq_len=16, layers=3, hidden=180, heads=4)
    hw = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 << 30, cpu_adam_params_per_s=1e9)
    work = Workload(batch=1, seq=16, precision=precision, host_reserve_bytes=0)
    plan = make_plan(cfg, work, hw, window=2, resident_blocks=0)
    model = GPT(cfg)
    engine = ph.wrap(model, blocks=model.blocks, window=2, precision=precision)
    try:
        arenas = engine.memory_report().host_arenas
        assert arenas == len(layout.stored_states(engine.dtype))  # one arena per state at this size
        assert plan.host.host_bytes == engine.placement.host_bytes
        assert plan.host.host_bytes == engine.memory_report().host_store_bytes - arenas * layout.ARENA_ALIGN
        padded = list(engine.memory_report().streamed_block_elements)
        assert padded == [plan.costs.block_numel] * 3 and plan.costs.block_numel > plan.costs.block_params
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_frozen_and_trainable_bytes_are_a_built_engines(precision):
    """``plan --freeze`` on a GPT with every block's attention frozen (weights and biases, so the
    frozen part has padding of its own) against ``wrap`` of that GPT with the same parameters
    frozen: parameter counts, the store's frozen bytes, its host bytes and the window slot are the
    engine's exactly. The report's frozen host bytes count parameters, not padded elements: they
    are short by the padding only, under ``ALIGN_ELEMS`` elements per frozen parameter; likewise
    the trainable part is 16 B/param plus padding and page rounding."""
    from pystronghold.planner.plan import make_plan
    from pystronghold.planner.report import finetune_to_dict
    from pystronghold.planner.trainable import check_freeze
    from pystronghold.settings.finetune import FinetuneOptions

    cfg = GPTConfig(vocab_size=97, seq_len=16, layers=3, hidden=180, heads=4)
    freeze = r"\.attn\."
    hw = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 << 30, cpu_adam_params_per_s=1e9)
    work = Workload(batch=1, seq=16, precision=precision, host_reserve_bytes=0, finetune=FinetuneOptions(freeze=freeze))
    check_freeze(cfg, work.finetune)
    plan = make_plan(cfg, work, hw, window=2, resident_blocks=0)
    model = GPT(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(".attn." not in name)
    engine = ph.wrap(model, blocks=model.blocks, window=2, precision=precision)
    try:
        stats = engine.stats()
        assert (stats["trainable_params"], stats["frozen_params"]) == (plan.trainable_params, plan.frozen_params)
        assert plan.frozen_params == 3 * (3 * 180 * 180 + 3 * 180 + 180 * 180 + 180)
        itemsize = engine.dtype.itemsize
        assert stats["store_frozen_bytes"] == 3 * plan.costs.block_frozen_numel * itemsize
        padding = stats["store_frozen_bytes"] - finetune_to_dict(plan)["frozen_host_bytes"]
        assert 0 < padding < 3 * 4 * layout.ALIGN_ELEMS * itemsize  # 4 frozen parameters per block
        # the store: the placement's bytes, plus one alignment of slack per arena
        arenas = engine.memory_report().host_arenas
        assert plan.host.host_bytes == engine.placement.host_bytes
        assert stats["store_bytes"] == plan.host.host_bytes + arenas * layout.ARENA_ALIGN
        # the rest holds the 8 trainable parameters of each block (norms, MLP) in every state
        trainable_params = plan.costs.block_params - plan.costs.block_frozen_params
        extra = plan.host.host_bytes - stats["store_frozen_bytes"] - 3 * 16 * trainable_params
        states = len(layout.stored_states(engine.dtype))
        assert 0 <= extra < 3 * (states * layout.ARENA_ALIGN + 16 * 8 * layout.ALIGN_ELEMS)
        assert stats["planned_arena_bytes"] == 2 * plan.costs.slot_bytes
    finally:
        engine.close()
