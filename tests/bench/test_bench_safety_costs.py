"""bench/safety_costs.py runs end to end on tiny sizes and records both comparisons (its own check
that the side-output watch leaves a model without side outputs at the same losses included); no
time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pystronghold.bench_suite import bench_dir

pytest.importorskip("transformers")


def test_safety_costs_records_both_paired_ratios(tmp_path):
    out = tmp_path / "costs.json"
    proc = subprocess.run([sys.executable, str(bench_dir() / "safety_costs.py"), "--rounds", "10", "--hidden", "32",
                           "--llama-layers", "2", "--llama-hidden", "64", "--seq", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert [r["subject"] for r in records] == ["finite-check", "side-outputs"]
    assert all(r["ratio_p20"] <= r["ratio"] <= r["ratio_p80"] and r["baseline_ms"] > 0 for r in records)
