"""The schedule, the window's invariants, and strict mode catching a missing wait."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pystronghold.runtime.streaming.schedule import Load, Release, build_plan
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import (HetStack, SlowCopies, assert_same_training, het_batches, one_torch_thread,
                            train_engine, train_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)


# ---- schedule


@pytest.mark.parametrize("n,w", [(1, 1), (5, 1), (5, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("train", [True, False])
def test_plan_keeps_every_use_resident_and_at_most_w(n, w, train):
    plan = build_plan(n, w, train)
    resident = {a.block: a.slot for a in plan.prologue}
    assert plan.max_resident() == w
    for k, use in enumerate(plan.uses):
        assert resident.get(use.block) == plan.slot_at[k], (k, use)
        for a in plan.after[k]:
            if isinstance(a, Release):
                assert resident.pop(a.block) == a.slot
            else:
                assert a.slot not in resident.values(), "a slot is loaded while still holding a block"
                resident[a.block] = a.slot
        assert len(resident) <= w
    assert not resident


def test_plan_prefetches_w_minus_1_ahead_and_keeps_the_tail_for_backward():
    plan = build_plan(6, 3, train=True)
    assert [a.block for a in plan.prologue] == [0, 1, 2]
    assert plan.after[0] == [Release(0, 0), Load(3, 0)]  # block 0 done -> block 3 into its slot
    assert plan.after[5] == []  # blocks 3, 4, 5 stay for the start of backward
    loads = [a for acts in plan.after for a in acts if isinstance(a, Load)]
    assert [a.block for a in loads] == [3, 4, 5, 2, 1, 0]  # each block reloaded once in backward


def test_plan_rejects_bad_sizes():
    with pytest.raises(ValueError, match="window"):
        build_plan(4, 5, True)
    with pytest.raises(ValueError, match="n_blocks"):
        build_plan(0, 1, True)


# ---- invariants during training


class _Probe:
    """Checks the invariants at every block entry while training runs."""

    def __init__(self, engine) -> None:
        self.engine, self.checks = engine, 0
        inner = engine.enter

        def enter(block, phase, train):
            inner(block, phase, train)
            assert len(engine_parts_for_tests(engine)["window"].resident) <= engine.window_size
            assert engine.backend.arena_used_bytes <= engine.planned_arena_bytes
            self.checks += 1

        engine.enter = enter


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_invariants_hold_at_every_block(overlap):
    probes = []
    batches = het_batches(4)
    losses, _, engine = train_engine(HetStack(), batches, window=2, overlap=overlap,
                                     engine_hook=lambda e: probes.append(_Probe(e)))
    assert probes[0].checks == 4 * 2 * 6  # every forward and backward use was checked
    assert engine.stats()["peak_resident"] == 2


def test_nothing_in_flight_after_step():
    model = HetStack()
    import pystronghold as ph

    for overlap in ("backward", "none", "forward"):
        m = copy.deepcopy(model)
        engine = ph.wrap(m, blocks=m.blocks, window=2, overlap=overlap)
        for x, y in het_batches(2):
            engine.backward(engine(x, y))
            engine.step()
            if overlap == "forward":  # host updates run on into the next forward, by design
                engine.synchronize()
            assert engine.in_flight() == 0
            assert not engine_parts_for_tests(engine)["window"].resident
            engine.zero_grad()
        engine.close()


def test_evicted_block_parameters_are_empty_placeholders():
    model = HetStack()
    import pystronghold as ph

    engine = ph.wrap(model, blocks=model.blocks, window=2)
    assert all(p.numel() == 0 for p in model.blocks.parameters())
    with pytest.raises(RuntimeError, match="out of the expected order"):
        model.blocks[3](torch.randn(2, 5, 24))
    engine.close()


# ---- strict mode catches a missing wait


def _slow(engine, skip_wait: bool):
    engine.backend.copies = SlowCopies(engine.backend.copies, delay_s=0.03, queues=(0,))  # slow loads
    if skip_wait:
        engine_parts_for_tests(engine)["executor"].test_skip_waits.add("load")


def test_strict_mode_catches_a_removed_wait():
    batches = het_batches(2)
    model = HetStack()
    ref = train_reference(copy.deepcopy(model), batches)
    # with its waits, the slow-copy engine still trains exactly
    good = train_engine(copy.deepcopy(model), batches, window=1, strict=True,
                        engine_hook=lambda e: _slow(e, skip_wait=False))
    assert_same_training(ref, good)
    # without the compute-waits-for-load, compute reads the poisoned (NaN) slot: the loss and the
    # gradients turn NaN and the first host update refuses them
    losses = []
    with pytest.raises(FloatingPointError, match="inf/NaN"):
        train_engine(copy.deepcopy(model), batches, window=1, strict=True,
                     engine_hook=lambda e: (_slow(e, skip_wait=True), _record_losses(e, losses)))
    assert losses and not math.isfinite(losses[0])


def test_strict_mode_catches_a_read_before_a_slots_first_load():
    """W=all: no slot is released before its first use, so only a poisoned fresh slot turns a
    compute that does not wait for the first loads into NaN (fresh device memory reads as zeros,
    often: plausible, wrong numbers)."""
    batches = het_batches(2)
    model = HetStack()
    losses = []
    with pytest.raises(FloatingPointError, match="inf/NaN"):
        train_engine(copy.deepcopy(model), batches, window=len(model.blocks), strict=True,
                     engine_hook=lambda e: (_slow(e, skip_wait=True), _record_losses(e, losses)))
    assert losses and not math.isfinite(losses[0])


def _record_losses(engine, out):
    inner = engine.backward

    def backward(loss):
        out.append(loss.item())
        inner(loss)

    engine.backward = backward


# ---- store layout


def test_block_layout_aligns_offsets_and_keeps_gaps_zero():
    from pystronghold.runtime.memory.layout import ALIGN_ELEMS
    from pystronghold.runtime.memory.store import BlockLayout

    block = HetStack().blocks[2]  # attention block: odd-sized tensors
    named = list(block.named_parameters())
    layout = BlockLayout(named)
    assert all(s.offset % ALIGN_ELEMS == 0 for s in layout.spans)
    assert layout.numel % ALIGN_ELEMS == 0
    flat = torch.full((layout.numel,), 7.0)
    for view, (_, p) in zip(layout.views(flat), named):
        view.copy_(p.detach())
    layout.zero_gaps(flat)
    covered = sum(s.numel for s in layout.spans) + sum(e - s for s, e in layout.gaps)
    assert covered == layout.numel  # spans and gaps tile the buffer exactly
    for start, end in layout.gaps:
        assert torch.all(flat[start:end] == 0)
    for view, (_, p) in zip(layout.views(flat), named):
        assert torch.equal(view, p.detach())
