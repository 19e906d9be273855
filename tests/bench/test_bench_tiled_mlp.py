"""bench/tiled_mlp.py runs end to end at 1,024 tokens: the block's working set, measured, is smaller
over tiles than untiled in backward by at least the (T, F) intermediates the tiles avoid."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pystronghold.bench_suite import bench_dir

pytest.importorskip("transformers")


def test_tiled_mlp_reports_a_smaller_working_set_over_tiles(tmp_path):
    out = tmp_path / "tiled_mlp.json"
    cmd = [sys.executable, str(bench_dir() / "tiled_mlp.py"), "--seqs", "1024", "--tiles", "0", "128",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    untiled, tiled = json.loads(out.read_text())["records"]
    assert (untiled["tile"], tiled["tile"]) == (0, 128)
    one = untiled["intermediate_bytes"]  # one (T, F) fp32 tensor
    assert tiled["backward_bytes"] + 2 * one <= untiled["backward_bytes"]
    assert tiled["forward_bytes"] + one <= untiled["forward_bytes"]
