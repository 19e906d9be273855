"""The rest of a step is named: model, engine and step spans in the trace, which on
the CPU backend are disjoint from the compute spans and lie within the step."""

from __future__ import annotations

import time

import pytest

import pystronghold as ph
from pystronghold.runtime.tracing.host_time import HOST_KINDS
from pystronghold.runtime.tracing.trace import COMPUTE_KINDS
from runtime_models import gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)

def _disjoint(spans) -> bool:
    spans = sorted(spans)
    return all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("options", [dict(window=2), dict(window="all", checkpointing=False),
                                     dict(window=2, resident_blocks=1, accumulation_steps=2)])
def test_host_spans_name_the_rest_of_the_step_without_overlapping_compute(options):
    model = tiny_gpt(layers=4)
    engine = ph.wrap(model, blocks=model.blocks, trace=True, **options)
    acc = options.get("accumulation_steps", 1)
    engine.trace.clear()
    t0 = time.monotonic()
    for x, y in gpt_batches(acc):
        engine.backward(engine(x, y))
    engine.step()
    wall = time.monotonic() - t0
    engine.zero_grad()
    events = engine.trace.events()
    kinds = {e.kind for e in events}
    assert set(HOST_KINDS) <= kinds, kinds
    streamed = engine.n_streamed
    first = engine.resident.count  # the trace numbers blocks as the model does
    engine_calls = sorted(e.block for e in events if e.kind == "engine")
    # one enter and one leave per streamed block and pass (forward, backward), per micro-batch
    assert engine_calls == sorted(list(range(first, first + streamed)) * 4 * acc)
    assert sum(e.kind == "step" for e in events) == 1
    assert all(e.lane == "host" for e in events if e.kind in HOST_KINDS)
    # on the CPU backend the host spans and the compute spans are disjoint host time ...
    timed = [(e.start_s, e.end_s) for e in events if e.kind in COMPUTE_KINDS or e.kind in HOST_KINDS]
    assert _disjoint(timed)
    # ... and all lie within the measured step
    assert min(s for s, _ in timed) >= t0 and max(e for _, e in timed) <= t0 + wall
    engine.close()


def test_untraced_engine_records_nothing():
    model = tiny_gpt(layers=2)
    engine = ph.wrap(model, blocks=model.blocks, window=1, trace=False)
    (x, y), = gpt_batches(1)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.trace.events() == []
    engine.close()
