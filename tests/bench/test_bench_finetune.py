"""bench/finetune.py runs end to end on a tiny Llama and records what frozen weights save: every
configuration's losses agree with its reference, frozen parameters cost fewer host bytes per
parameter than the full fine-tune's, and frozen blocks send no gradient back over the link. No time
is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pystronghold.bench_suite import bench_dir

pytest.importorskip("transformers")


def test_finetune_records_losses_host_bytes_and_link_bytes(peft, tmp_path):
    out = tmp_path / "finetune.json"
    proc = subprocess.run([sys.executable, str(bench_dir() / "finetune.py"), "--layers", "2", "--hidden", "64",
                           "--seq", "16", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = {r["config"]: r for r in payload["records"]}
    expected = {"plain full", "ours full", "plain freeze", "ours freeze", "plain LoRA", "ours LoRA"}
    assert expected <= set(rows)
    assert all(r["loss_max_rel_diff"] <= payload["loss_rtol"] for r in rows.values() if r["reference"] != "-")
    full = rows["ours full"]
    for name in ("ours freeze", "ours LoRA"):
        assert rows[name]["frozen_B/param"] == pytest.approx(4.0, rel=0.01)  # fp32: the value alone
        assert rows[name]["host_B/param"] < full["host_B/param"]
        assert rows[name]["d2h_MB/step"] < full["d2h_MB/step"]  # no gradient copy-out for frozen parameters
    assert rows["ours LoRA"]["d2h_MB/step"] < rows["ours freeze"]["d2h_MB/step"]
    if "accelerate LoRA" in rows:
        assert rows["accelerate LoRA"]["reference"] == "ours LoRA"
