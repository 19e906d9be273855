"""Device-timed spans: durations from the device's events, placed on the host clock by one
calibration per step (pystronghold/runtime/tracing/timing.py). Fake events stand in for CUDA's on the CPU;
the last test runs on a GPU only."""

from __future__ import annotations

import time

import pytest
import torch

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.runtime.backends.backend_cuda import EventHandle
from pystronghold.runtime.tracing.timing import Calibration, EventClock, HostClock, copy_marks, to_host_s
from pystronghold.runtime.tracing.trace import Tracer
from runtime_models import gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)


class FakeGPU:
    """A device clock the test moves by hand (seconds), and a host clock far from it."""

    def __init__(self) -> None:
        self.device_s = 0.0
        self.host_s = 1000.0


class FakeStream:
    """Work on it runs at the device times the test names: the next event recorded gets ``at``."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.at = gpu, 0.0


class FakeEvent:
    """torch.cuda.Event's timing surface: record, query, synchronize, elapsed_time (ms)."""

    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.t = gpu, None

    def record(self, stream: FakeStream) -> None:
        self.t = stream.at

    def query(self) -> bool:
        return self.t is not None and self.t <= self.gpu.device_s

    def synchronize(self) -> None:
        self.gpu.host_s += max(0.0, self.t - self.gpu.device_s)  # the host waits as long as the device
        self.gpu.device_s = max(self.gpu.device_s, self.t)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not happened"
        return (end.t - self.t) * 1e3


def fake_clock():
    gpu = FakeGPU()
    compute, copy = FakeStream(gpu), FakeStream(gpu)
    clock = EventClock(lambda: FakeEvent(gpu), lambda: compute, host_now=lambda: gpu.host_s)
    return gpu, compute, copy, clock


def test_copy_spans_take_device_durations_not_issue_to_observed():
    gpu, compute, copy, clock = fake_clock()
    tracer = Tracer()
    # a 4 MB copy the device runs from 2.000 to 2.004 s; the host issues it at host 1000.0 ...
    copy.at = 2.000
    start = clock.mark(copy)
    copy.at = 2.004
    handle = EventHandle(clock.mark(copy), 4_000_000, start_mark=start)
    compute.at = 1.990
    with tracer.span("compute_fwd", 0, clock=clock):
        compute.at = 2.010
    gpu.device_s = 2.015
    gpu.host_s = 1000.5  # ... and first sees it done half a second later
    assert handle.done()
    tracer.defer("h2d", 1, *copy_marks(handle), handle.nbytes)
    assert tracer.events() == [] and tracer.pending() == 2
    compute.at = 2.020  # the calibration event: the device reaches it 5 ms later, the host reads 1000.505
    assert tracer.resolve(clock.calibrate) == 2
    events = {e.kind: e for e in tracer.events()}
    h2d, fwd = events["h2d"], events["compute_fwd"]
    # host = 1000.505 - (2.020 - device)
    assert h2d.start_s == pytest.approx(1000.485) and h2d.end_s == pytest.approx(1000.489)
    assert h2d.duration_s == pytest.approx(0.004)
    assert fwd.start_s == pytest.approx(1000.475) and fwd.duration_s == pytest.approx(0.020)
    s = tracer.summary()
    assert s.gbps["h2d"] == pytest.approx(1.0)  # 4 MB in 4 ms (issue to observed would say 0.008)
    assert s.overlap_fraction == pytest.approx(1.0)  # the copy ran inside the compute


def test_spans_not_yet_done_wait_for_a_later_calibration():
    gpu, compute, copy, clock = fake_clock()
    tracer = Tracer()
    copy.at = 1.0
    first = clock.mark(copy)
    copy.at = 1.5
    tracer.defer("h2d", 0, first, clock.mark(copy), 100)
    copy.at = 3.0
    late_start = clock.mark(copy)
    copy.at = 3.25
    tracer.defer("d2h", 0, late_start, clock.mark(copy), 100)
    gpu.device_s, gpu.host_s = 2.0, 1000.0  # the first copy is done, the second is not
    compute.at = 2.0
    assert tracer.resolve(clock.calibrate) == 1
    assert [e.kind for e in tracer.events()] == ["h2d"] and tracer.pending() == 1
    gpu.device_s, gpu.host_s = 3.5, 1001.5  # later: the second copy is done too
    compute.at = 4.0  # the next calibration: the host waits 0.5 s for the device to get there
    assert tracer.resolve(clock.calibrate) == 1
    h2d, d2h = tracer.events()
    # both calibrations find the host clock 998 s ahead of the device's
    assert (h2d.start_s, h2d.end_s) == pytest.approx((999.0, 999.5))
    assert (d2h.start_s, d2h.end_s) == pytest.approx((1001.0, 1001.25))

def test_clear_keeps_the_device_spans_not_resolved_yet():
    """A log point clears the trace while a span may still run on the device: it is recorded in the
    next interval, when a calibration finds it done."""
    gpu, compute, copy, clock = fake_clock()
    tracer = Tracer()
    copy.at = 1.0
    start = clock.mark(copy)
    copy.at = 1.5
    tracer.defer("h2d", 1, start, clock.mark(copy), 100)
    tracer.record("compute_fwd", 0, 10.0, 11.0)
    gpu.device_s, gpu.host_s = 0.5, 1000.0  # the copy has not run yet
    compute.at = 0.5
    assert tracer.resolve(clock.calibrate) == 0
    tracer.clear()
    assert tracer.events() == [] and tracer.pending() == 1
    gpu.device_s, gpu.host_s = 2.0, 1001.0  # done now: placed by the next calibration
    compute.at = 2.0
    assert tracer.resolve(clock.calibrate) == 1
    (h2d,) = tracer.events()
    assert (h2d.kind, h2d.block, h2d.nbytes) == ("h2d", 1, 100)
    assert (h2d.start_s, h2d.end_s) == pytest.approx((1000.0, 1000.5))


def test_host_marks_are_recorded_at_once_and_device_marks_need_a_calibration():
    tracer = Tracer()
    tracer.defer("optimizer", 0, 1.0, 2.5)
    assert tracer.pending() == 0 and tracer.events()[0].duration_s == pytest.approx(1.5)
    with tracer.span("compute_fwd", 0, clock=HostClock()):
        pass
    assert tracer.pending() == 0 and len(tracer.events()) == 2
    assert HostClock().calibrate() is None
    gpu, compute, _, clock = fake_clock()
    mark = clock.mark()
    gpu.device_s = 1.0
    with pytest.raises(ValueError, match="calibration"):
        to_host_s(mark, None)
    assert to_host_s(mark, Calibration(mark, 7.0)) == pytest.approx(7.0)
    disabled = Tracer(enabled=False)
    disabled.defer("h2d", 0, mark, mark)
    assert disabled.pending() == 0


class DeviceOffsetClock(EventClock):
    """An EventClock over fake events stamped with a device clock 5 s ahead of the host's: every
    span the engine times through its backend's clock becomes a device mark."""

    def __init__(self) -> None:
        def now():
            return time.monotonic() + 5.0

        class Event:
            def record(self, stream=None):
                self.t = now()

            def query(self):
                return self.t <= now()

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        super().__init__(Event, lambda: None)
        self.calibrations = 0

    def calibrate(self):
        self.calibrations += 1
        return super().calibrate()


def test_engine_times_compute_and_waits_through_its_backend_clock():
    model = tiny_gpt(layers=4)
    engine = ph.wrap(model, blocks=model.blocks, window=2, trace=True)
    clock = engine.backend.clock = DeviceOffsetClock()
    x, y = gpt_batches(1)[0]
    t0 = time.monotonic()
    engine.backward(engine(x, y))
    # compute spans are device marks: held until the step's calibration
    assert engine.trace.pending() >= 8 and not any(e.kind.startswith("compute") for e in engine.trace.events())
    engine.step()
    t1 = time.monotonic()
    assert clock.calibrations == 1 and engine.trace.pending() == 0
    compute = [e for e in engine.trace.events() if e.kind in ("compute_fwd", "compute_bwd", "recompute")]
    assert len(compute) == 12
    # placed on the host clock by the calibration (uncalibrated they would sit 5 s later)
    assert all(t0 - 0.05 <= e.start_s <= e.end_s <= t1 + 0.05 for e in compute)
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copy_spans_fit_in_the_step_and_bandwidth_is_plausible():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, seq_len=128, layers=6, hidden=512, heads=8))
    engine = ph.wrap(model, blocks=model.blocks, window=2, trace=True, device="cuda")
    batches = [(x.cuda(), y.cuda()) for x, y in gpt_batches(3)]
    for k, (x, y) in enumerate(batches):
        if k == len(batches) - 1:  # the last step is the one measured
            engine.synchronize()
            engine.trace.clear()
            t0 = time.monotonic()
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    wall = time.monotonic() - t0
    events = engine.trace.events()
    h2d = [e for e in events if e.kind == "h2d"]
    assert h2d and engine.trace.pending() == 0
    assert sum(e.duration_s for e in h2d) <= wall
    assert all(t0 - 1e-3 <= e.start_s and e.end_s <= t0 + wall + 1e-3 for e in events)
    s = engine.trace.summary()
    assert 0.0 < s.gbps["h2d"] < 100.0 and 0.0 < s.gbps["d2h"] < 100.0
    engine.close()


def test_timeline_png_widens_copies_but_not_stalls(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.axes

    drawn = {}
    original = matplotlib.axes.Axes.broken_barh

    def spy(self, xranges, yrange, **kwargs):
        drawn[round(yrange[0] + 0.4)] = list(xranges)
        return original(self, xranges, yrange, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "broken_barh", spy)
    t = Tracer()
    t.record("compute_fwd", 0, 0.0, 1.0)
    t.record("h2d", 1, 0.25, 0.25, nbytes=8)  # a copy too short to see: drawn min_event_width of the span
    t.record("wait", 1, 0.5, 0.5)  # a stall of nothing (the copy was done): drawn as nothing
    t.write_png(tmp_path / "timeline.png", title="test", min_event_width=0.01)
    assert drawn[0] == [(0.0, 1000.0)]  # rows: compute, h2d, stall; milliseconds
    assert drawn[1] == [(250.0, 1000.0 * 0.01)]
    assert drawn[2] == [(500.0, 0.0)]
