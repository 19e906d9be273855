"""bench/hf_load.py --small runs end to end on a tiny Llama: every contender (transformers bf16 and
fp32, pystronghold with every block state on disk) reports a load time and a peak resident set, and
pystronghold its store's host and disk bytes. At this size the figures are dominated by allocator
noise, so only their presence and sign are checked (the claim is made at 1.1B, docs/BENCHMARKS.md);
no time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pystronghold.bench_suite import bench_dir

pytest.importorskip("transformers")


def test_hf_load_small_reports_every_contender(tmp_path):
    out = tmp_path / "hf_load.json"
    cmd = [sys.executable, str(bench_dir() / "hf_load.py"), "--small", "--dir", str(tmp_path / "cache"),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {r["loader"]: r for r in payload["records"]}
    assert set(rows) == {"transformers bf16", "transformers fp32", "pystronghold"}
    for row in rows.values():
        assert row["baseline_MiB"] > 0 and row["load_s"] > 0 and row["forward_s"] > 0
        assert row["forward_MiB"] >= row["loaded_MiB"] >= 0  # peaks only grow
        assert row["ready_s"] >= row["load_s"] and row["peak_x transformers fp32"] > 0
    ours = rows["pystronghold"]
    assert ours["step_MiB"] >= ours["forward_MiB"] and ours["first_step_s"] > 0
    assert ours["store_disk_MiB"] > ours["store_host_MiB"] > 0  # every state on disk, one block cached
    assert ours["accounted_MiB"] > ours["head_tail_MiB"] > 0
    assert payload["parameters"] == payload["shape"]["layers"] * payload["block_parameters"] + \
        payload["head_tail_parameters"]
    # the model was kept in --dir for the next run; the NVMe scratch was removed
    kept = list((tmp_path / "cache").iterdir())
    assert [p.name for p in kept] == ["llama-4x64-ffn176-h4-kv2-v512"]
    assert (kept[0] / "config.json").exists()
