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
    slot_bytes = engine.store.layouts[0].numel * 4
    assert all(e.nbytes == slot_bytes for e in events if e.kind in ("h2d", "d2h"))
    assert all(e.end_s >= e.start_s for e in events)
    summary = engine.trace.summary()
    assert 0.0 <= summary.overlap_fraction <= 1.0
    assert summary.bytes["h2d"] == 12 * slot_bytes
    path = engine.trace.write_chrome_json(tmp_path / "trace.json")
    names = {e["name"] for e in json.loads(path.read_text())["traceEvents"]}
    assert "compute_fwd 0" in names and "optimizer 3" in names
    engine.close()
