"""bench/whale.py, the slowed-rank experiment: the even and the hardware-aware split train to the
same losses (3 gloo ranks, one slowed by a per-sample delay). Times are the benchmark's to report;
this test checks the numbers only (never a timing), and that a mismatch is caught."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from pystronghold.bench_suite import bench_dir


def _whale():
    # NOTE: imported by name from bench/ on sys.path, not from a file spec: the spawned ranks
    # unpickle _rank_main by its module name, and spawn hands them the parent's sys.path.
    if str(bench_dir()) not in sys.path:
        sys.path.insert(0, str(bench_dir()))
    return importlib.import_module("whale")


def test_slowed_rank_even_and_aware_splits_give_the_same_losses():
    whale = _whale()
    rec = whale.run(dict(ranks=3, delay_ms=5.0, global_batch=6, layers=2, hidden=32, seq=16, steps=2, warmup=2))
    assert len(rec["loss_even"]) == len(rec["loss_aware"]) == 4
    assert sum(rec["sizes"]) == 6 and min(rec["sizes"]) >= 1
    whale.check_losses(rec)  # raises when any step's losses differ by more than 1e-5 relative
    bad = dict(rec, loss_aware=[x * 1.001 for x in rec["loss_aware"]])
    with pytest.raises(AssertionError, match="step 0: even-split loss"):
        whale.check_losses(bad)
