import json
import threading

import pytest
import torch

from pystronghold.runtime.tracing.trace import Tracer


def synthetic() -> Tracer:
    """A hand-made step (seconds). Expected figures are worked out in the tests below."""
    t = Tracer()
    t.record("compute_fwd", 0, 0.0, 4.0)
    t.record("compute_fwd", 1, 5.0, 9.0)
    t.record("h2d", 1, 1.0, 6.0, nbytes=1_000_000_000)
    t.record("h2d", 2, 3.0, 7.0, nbytes=1_000_000_000)  # concurrent with the first copy
    t.record("wait", 1, 4.0, 5.0)
    t.record("optimizer", 0, 8.0, 11.0)
    t.record("d2h", 0, 10.0, 12.0, nbytes=4_000_000_000)
    t.record("file_read", 3, 12.0, 14.0, nbytes=2_000_000_000)
    return t


def test_summary_of_synthetic_step():
    s = synthetic().summary()
    assert s.events == 8
    assert s.wall_s == pytest.approx(14.0)
    # background union: h2d [1,7] + optimizer/d2h/file_read [8,14] = 12 s;
    # compute [0,4] u [5,9]; shared: [1,4] + [5,7] + [8,9] = 6 s -> 6 / 12
    assert s.overlap_fraction == pytest.approx(0.5)
    assert s.stall_s == pytest.approx(1.0)
    assert s.busy_s == pytest.approx({"compute": 8.0, "h2d": 6.0, "d2h": 2.0, "optimizer": 3.0,
                                      "file_io": 2.0, "stall": 1.0})
    assert s.time_s["h2d"] == pytest.approx(9.0)  # 5 + 4: concurrent copies each counted
    assert s.bytes == {"h2d": 2_000_000_000, "d2h": 4_000_000_000, "file_read": 2_000_000_000}
    # h2d: 2 GB over the 6 s some h2d copy was in flight
    assert s.gbps == pytest.approx({"h2d": 2 / 6, "d2h": 2.0, "file_read": 1.0})
    assert "overlap=50.0%" in s.line()


def test_fully_hidden_and_fully_exposed():
    t = Tracer()
    t.record("compute_bwd", 0, 0.0, 10.0)
    t.record("d2h", 0, 2.0, 3.0, nbytes=10)
    t.record("optimizer", 0, 3.0, 9.0)
    assert t.summary().overlap_fraction == pytest.approx(1.0)
    t.clear()
    t.record("compute_bwd", 0, 0.0, 1.0)
    t.record("d2h", 0, 1.0, 3.0, nbytes=10)  # touching, not overlapping
    assert t.summary().overlap_fraction == pytest.approx(0.0)


def test_summary_with_nothing_to_hide():
    t = Tracer()
    assert t.summary().events == 0 and t.summary().overlap_fraction is None
    t.record("compute_fwd", 0, 1.0, 2.0)
    s = t.summary()
    assert s.overlap_fraction is None and s.bytes == {} and s.wall_s == pytest.approx(1.0)


def test_lane_override_and_unknown_kind():
    t = Tracer()
    t.record("h2d", 0, 0.0, 1.0, nbytes=8, lane="h2d:stream1")
    t.record("allreduce", 0, 0.5, 2.0)
    s = t.summary()
    assert set(s.busy_s) == {"h2d:stream1", "allreduce"}
    assert s.bytes == {"h2d": 8}  # kinds, not lanes, decide bandwidth


def test_chrome_json_has_one_row_per_lane_in_microseconds(tmp_path):
    t = synthetic()
    path = t.write_chrome_json(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 8
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert [names[i] for i in sorted(names)] == ["compute", "h2d", "d2h", "optimizer", "file_io", "stall"]
    d2h = next(e for e in complete if e["cat"] == "d2h")
    assert names[d2h["tid"]] == "d2h"
    assert d2h["ts"] == pytest.approx(10e6) and d2h["dur"] == pytest.approx(2e6)  # microseconds
    assert d2h["args"] == {"block": 0, "bytes": 4_000_000_000}
    assert d2h["name"] == "d2h 0"


def test_span_records_even_when_the_body_raises():
    t = Tracer()
    with t.span("h2d", 3, nbytes=64):
        pass
    with pytest.raises(RuntimeError):
        with t.span("compute_fwd", 4):
            raise RuntimeError("boom")
    events = t.events()
    assert [(e.kind, e.block, e.nbytes, e.lane) for e in events] == [
        ("h2d", 3, 64, "h2d"), ("compute_fwd", 4, 0, "compute")]
    assert events[0].end_s <= events[1].start_s  # each span timed over its own body


def test_span_shows_in_torch_profiler():
    t = Tracer()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with t.span("optimizer", 7):
            torch.ones(4).sum()
    assert any(evt.name == "pystronghold::optimizer[7]" for evt in prof.events())


def test_disabled_tracer_records_nothing():
    t = Tracer(enabled=False)
    t.record("h2d", 0, 0.0, 1.0)
    with t.span("compute_fwd", 0):
        pass
    assert t.events() == []


@pytest.mark.parametrize("args, match", [
    (("", 0, 0.0, 1.0), "kind"),
    (("h2d", 0, 2.0, 1.0), "before"),
    (("h2d", 0, 0.0, 1.0, -5), "nbytes"),
])
def test_records_with_bad_times_or_bytes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        Tracer().record(*args)


def test_concurrent_recording_loses_nothing():
    t = Tracer()
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        barrier.wait()
        for i in range(2000):
            t.record("h2d", k, float(i), float(i) + 0.5, nbytes=1)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t.events()) == 8000
    assert t.summary().bytes["h2d"] == 8000
    t.clear()
    assert t.events() == []


def test_norm_pass_counts_as_host_work():
    t = Tracer()
    t.record("compute_bwd", 0, 0.0, 4.0)
    t.record("norm", 1, 3.0, 5.0)  # half hidden behind compute
    s = t.summary()
    assert s.busy_s["optimizer"] == pytest.approx(2.0)
    assert s.overlap_fraction == pytest.approx(0.5)


def test_write_png_writes_a_png_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = synthetic().write_png(tmp_path / "trace.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
