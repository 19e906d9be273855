"""`pystronghold bench`: runs a real script, reads its JSON headline, lists missing scripts, bad names."""

from __future__ import annotations

import json

from pystronghold.bench_suite import HEADLINES, bench_dir, load_label
from pystronghold.cli import main


def test_bench_runs_kernels_reference_and_reports_a_ratio(tmp_path, capsys):
    code = main(["bench", "kernels", "nvme", "--out", str(tmp_path), "--quiet-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    payload = json.loads((tmp_path / "kernels.json").read_text())
    what, ratio, spread, base = HEADLINES["kernels"](payload["records"])
    assert ratio > 0 and f"{ratio:.2f}x ({spread[0]:.2f}-{spread[1]:.2f})" in out and base in out
    assert spread[0] <= spread[1] and load_label(payload["records"]) in out
    assert "skipped" in out.split("nvme", 1)[1].splitlines()[0] or (bench_dir() / "nvme.py").exists()


def test_bench_unknown_name(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark" in err and len(err.strip().splitlines()) == 1


def test_every_headline_reads_its_scripts_records():
    """The extractors against records shaped as the scripts write them (field names checked in
    the scripts' sources, so a renamed field fails here)."""
    sources = {name: (bench_dir() / f"{name}.py").read_text() for name in HEADLINES}
    for name, fields in {"adam": ["x_{base}_p20", "params_m", "tensors"], "copy_engine": ["ratio_p20", "size_mib"],
                         "window": ["vs_plain_p20", "bytes_vs_plain"], "kernels": ["speedup_p20", "fwdbwd_ms"],
                         "parallel": ["vs_1x1_p20", "procs"], "nvme": ["step time, states on disk", "ratio_p20"],
                         "gpu_train": ["vs_plain", "device_peak_GiB", "losses_ok", "tflops"]
                         }.items():
        for f in fields:
            assert f in sources[name], (name, f)
    adam = HEADLINES["adam"]([{"case": "ours", "tensors": 1, "params_m": 4.0, "x_torch_fused": 1.5,
                               "x_torch_fused_p20": 1.4, "x_torch_fused_p80": 1.7},
                              {"case": "ours", "tensors": 1, "params_m": 1.0, "x_torch_fused": 9.0}])
    assert adam[1:3] == (1.5, (1.4, 1.7))
    window = HEADLINES["window"]([{"config": "W=4", "vs_plain": 0.5, "bytes_vs_plain": 0.3},
                                  {"config": "W=2", "vs_plain": 0.8, "bytes_vs_plain": 0.2, "vs_plain_p20": 0.5,
                                   "vs_plain_p80": 1.0},
                                  {"config": "W=all", "vs_plain": 1.0, "bytes_vs_plain": 0.6}])
    assert window[1:3] == (1.25, (1.0, 2.0))  # a time ratio inverted: its spread's ends swap
    nvme = [{"what": "tier write during training", "kind": "tier", "ratio": 0.9},
            {"what": "tier read during training", "kind": "tier", "ratio": 0.7},
            {"what": "step time, states on disk", "kind": "step", "ratio": 1.25, "ratio_p20": 1.0, "ratio_p80": 2.0}]
    assert HEADLINES["nvme"](nvme)[1:3] == (0.8, (0.5, 1.0))
    gpu = [{"config": "plain", "vs_plain": 1.0, "device_peak_GiB": 36.0, "tflops": 390.0, "losses_ok": True},
           {"config": "W=4", "vs_plain": 1.8, "device_peak_GiB": 12.0, "tflops": 210.0, "losses_ok": True},
           {"config": "W=2", "vs_plain": 2.0, "device_peak_GiB": 9.0, "tflops": 190.0, "losses_ok": True},
           {"config": "W=auto", "vs_plain": 1.9, "device_peak_GiB": 9.0, "tflops": 200.0, "losses_ok": True}]
    what, ratio, spread, _ = HEADLINES["gpu_train"](gpu)
    assert ratio == 0.5 and spread is None and "W=2" in what and "25% of its peak" in what
    assert HEADLINES["parallel"]([{"tp": 1, "dp": 1, "procs": 1, "vs_1x1": 1.0},
                                  {"tp": 2, "dp": 2, "procs": 4, "vs_1x1": 2.0}])[1:3] == (0.5, None)


def test_load_label_spans_the_records_and_marks_loaded_ones():
    quiet = {"load_start": 0.5, "load_end": 1.0, "loaded": False}
    busy = {"load_start": 1.5, "load_end": 3.5, "loaded": True}
    assert load_label([quiet]) == "0.5-1.0"
    assert load_label([quiet, busy]) == "0.5-3.5 LOADED"
    assert load_label([{"case": "no load fields"}]) == "?"
