"""bench/common.py's paired timing and load marking, on fake clocks and fake load readers (no real
time is measured or asserted)."""

from __future__ import annotations

import importlib.util
import statistics
import sys

import pytest

from pystronghold.bench_suite import bench_dir


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", bench_dir() / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


common = _common()


class FakeClock:
    """A clock that only moves when a fake workload advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drifting_pair(clock: FakeClock, ratio: float, order: list):
    """Functions a (costs `ratio` units) and b (1 unit) on a machine whose speed drifts: every call
    costs (1 + calls so far), as if the load rose steadily while they ran."""
    calls = [0]

    def work(name, units):
        def fn():
            calls[0] += 1
            order.append(name)
            clock.now += units * (1 + calls[0])
        return fn

    return work("a", ratio), work("b", 1.0)


def test_interleave_alternates_and_the_paired_ratio_cancels_the_drift():
    clock, order = FakeClock(), []
    a, b = drifting_pair(clock, 3.0, order)
    t = common.interleave({"a": a, "b": b}, rounds=12, warmup=2, clock=clock)
    assert order == ["a", "b"] * 14  # 2 warm-up rounds, then 12 timed, taking turns
    assert t["a"].reps == t["b"].reps == 12
    r = common.paired_ratio(t["a"], t["b"])  # a is the baseline: b is 3x faster than a
    # each pair sees the same drift; a ratio of a's median to b's median does not
    assert r.median == pytest.approx(3.0, rel=0.1) and r.pairs == 12
    assert r.p20 <= r.median <= r.p80
    exact = statistics.median((3.0 * (1 + 2 * k + 1)) / (1 + 2 * k + 2) for k in range(2, 14))
    assert r.median == pytest.approx(exact)


def test_paired_ratio_exact_on_a_constant_machine():
    base = [2.0, 4.0, 8.0, 2.0, 4.0, 8.0, 2.0, 4.0, 8.0, 2.0]  # the load varies between rounds
    cand = [x / 1.5 for x in base]                             # but within a round it is shared
    r = common.paired_ratio(base, cand)
    assert (r.median, r.p20, r.p80, r.pairs) == (pytest.approx(1.5), pytest.approx(1.5), pytest.approx(1.5), 10)
    assert r.scaled(2.0).median == pytest.approx(3.0) and r.label() == "1.50 (1.50-1.50)"


def test_paired_ratio_spread_is_p20_to_p80_of_the_ratios():
    base = [1.0] * 10
    cand = [1 / q for q in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]   # ratios 1..10
    r = common.paired_ratio(base, cand)
    assert (r.p20, r.median, r.p80) == (pytest.approx(3.0), pytest.approx(5.5), pytest.approx(9.0))


def test_pairing_refuses_unpaired_or_too_few_samples():
    with pytest.raises(ValueError, match="same rounds"):
        common.paired_ratio([1.0] * 10, [1.0] * 11)
    with pytest.raises(ValueError, match="at least 10"):
        common.paired_ratio([1.0] * 9, [1.0] * 9)
    with pytest.raises(ValueError, match="rounds=5"):
        common.interleave({"a": lambda: None}, rounds=5)
    with pytest.raises(ValueError, match="> 0"):
        common.paired_ratio([1.0] * 9 + [0.0], [1.0] * 10)


def test_interleave_min_time_adds_rounds_and_sync_runs_inside_the_time():
    clock, synced = FakeClock(), []

    def fn():
        clock.now += 1.0

    def sync():
        synced.append(1)
        clock.now += 0.5  # the device finishing its work belongs to the call's time

    t = common.interleave({"a": fn, "b": fn}, rounds=10, warmup=1, min_time_s=45.0, sync=sync, clock=clock)
    assert t["a"].reps == 15  # rounds of 3 s (a and b, 1.5 s each): 15 of them reach 45 s
    assert t["a"].median_s == 1.5 and len(synced) == 2 * 16


def test_load_above_the_core_count_is_marked_loaded():
    readings = iter([0.5, 2.5])
    load = common.LoadWatch(reader=lambda: next(readings), cores=2).stop()
    assert load.loaded and load.label() == "0.5-2.5 LOADED"
    assert load.fields() == {"load_start": 0.5, "load_end": 2.5, "loaded": True, "load": "0.5-2.5 LOADED"}
    quiet = common.Load(1.0, 2.0, cores=2)
    assert not quiet.loaded and quiet.label() == "1.0-2.0"
    assert common.any_loaded([quiet.fields(), load.fields()]) and not common.any_loaded([quiet.fields()])


def test_read_load_parses_proc_loadavg(tmp_path):
    f = tmp_path / "loadavg"
    f.write_text("3.25 1.50 0.75 2/345 6789\n")
    assert common.read_load(f) == 3.25


def _roofline():
    spec = importlib.util.spec_from_file_location("bench_roofline", bench_dir() / "roofline.py")
    roofline = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = roofline
    spec.loader.exec_module(roofline)
    return roofline


def test_ceiling_fraction_uses_each_rounds_fastest_kernel():
    roofline = _roofline()
    kernels = [roofline.Kernel("read", 1, 100, None), roofline.Kernel("copy", 2, 200, None)]
    # round i: read moves 100 B in 1 s (100 B/s); copy 200 B in 1 s or 4 s (200 or 50 B/s)
    times = {"read x1": common.Timing.of([1.0] * 10), "copy x2": common.Timing.of([1.0, 4.0] * 5)}
    frac = roofline.ceiling_fraction(times, kernels, [1.0] * 10, 50)  # the case: 50 B/s every round
    assert sorted([frac.p20, frac.median, frac.p80]) == [frac.p20, frac.median, frac.p80]
    assert (frac.p20, frac.p80) == (pytest.approx(0.25), pytest.approx(0.5))  # 50/200 or 50/100 by round
    assert frac.median == pytest.approx(0.375)


def test_roofline_probe_reports_every_kernel_against_the_fastest():
    """Every kernel and thread count is there, none above each round's ceiling, the leaders are the
    fastest per thread count; the caller's thread counts are restored (no timing is asserted)."""
    import torch

    from pystronghold._ext import native

    roofline = _roofline()
    before = (torch.get_num_threads(), native().get_num_threads())
    probe = roofline.Probe(1 << 12, 2)
    try:
        leaders, records = roofline.measure(probe, rounds=10, warmup=0)
    finally:
        probe.close()
    assert (torch.get_num_threads(), native().get_num_threads()) == before
    names = {(r["kernel"], r["threads"]) for r in records}
    assert names == {("memcpy", 1)} | {(k, t) for k in ("read", "fill", "copy", "copy_nt", "triad", "adam_shape")
                                       for t in (1, 2)}
    assert sorted(k.threads for k in leaders) == [1, 2]
    for k in leaders:
        top = max((r for r in records if r["threads"] == k.threads), key=lambda r: r["gb_s"])
        assert (top["kernel"], top["threads"]) == (k.name, k.threads)
    assert leaders[0].label == max(records, key=lambda r: r["gb_s"])["kernel"] + f" x{leaders[0].threads}"
    assert all(0 < r["of_ceiling_p20"] <= r["of_ceiling"] <= r["of_ceiling_p80"] <= 1.0 + 1e-12 for r in records)
    assert all("load" in r and r["pairs"] == 10 for r in records)
    with pytest.raises(ValueError, match="max_threads=0"):
        roofline.Probe(16, 0)
