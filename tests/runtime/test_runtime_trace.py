"""Every action of a training step shows up in engine.trace, which exports and summarises."""

from __future__ import annotations

import json

import pytest

import pystronghold as ph
from runtime_models import gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_trace_records_every_action(tmp_path, overlap):
    model = tiny_gpt(layers=4)
    engine = ph.wrap(model, blocks=model.blocks, window=2, trace=True, overlap=overlap)
    for x, y in gpt_batches(2):
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    events = engine.trace.events()
    kinds = {e.kind for e in events}
    assert {"compute_fwd", "recompute", "compute_bwd", "h2d", "d2h", "optimizer"} <= kinds
    per_step = {k: sum(e.kind == k for e in events) / 2 for k in ("compute_fwd", "h2d", "d2h", "optimizer")}
    # 4 forwards; loads: 2 + 2 in forward, 2 reloaded in backward; one copy-out and update per block
    assert per_step == {"compute_fwd": 4, "h2d": 6, "d2h": 4, "optimizer": 4}
    slot_bytes = engine.memory_report().streamed_block_elements[0] * 4
    assert all(e.nbytes == slot_bytes for e in events if e.kind in ("h2d", "d2h"))
    _assert_causal(events, blocks=4)
    summary = engine.trace.summary()
    assert summary.bytes["h2d"] == 12 * slot_bytes
    path = engine.trace.write_chrome_json(tmp_path / "trace.json")
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]}
    assert "compute_fwd 0" in names and "optimizer 3" in names
    engine.close()


def _assert_causal(events, blocks: int) -> None:
    """Per block, what the schedule must order, as the trace timed it (copies stamped by the copy
    workers, compute and updates by the host): a compute starts after the block's latest load
    ended; a gradient copy-out after the block's recompute ended and its backward began (the
    copy-out is issued inside the backward's span); an update after the copy-out ended; a load
    after the block's previous update ended (else it would upload stale parameters)."""
    needs = {"compute_fwd": "h2d", "recompute": "h2d", "compute_bwd": "h2d", "d2h": "recompute",
             "optimizer": "d2h", "h2d": "optimizer"}
    for b in range(blocks):
        mine = [e for e in events if e.block == b]
        for e in (e for e in mine if e.kind in needs):
            earlier = sorted((p for p in mine if p.kind == needs[e.kind] and p.start_s < e.start_s),
                             key=lambda p: p.start_s)
            if not earlier:
                assert e.kind == "h2d", f"block {b}: {e.kind} at {e.start_s:.6f} with no {needs[e.kind]} before it"
                continue  # the first load: nothing updated the block yet
            assert earlier[-1].end_s <= e.start_s, (f"block {b}: {e.kind} started at {e.start_s:.6f}, before "
                                                    f"its {earlier[-1].kind} ended at {earlier[-1].end_s:.6f}")
            if e.kind == "d2h":
                assert any(p.kind == "compute_bwd" and earlier[-1].end_s <= p.start_s <= e.start_s for p in mine)
