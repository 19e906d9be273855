"""bench/gpu_train.py: the CPU subset trains one tiny GPT every way the CPU allows, with the same
losses; without CUDA the GPU run says so in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import types
import sys

import pytest
import torch

from pystronghold.bench_suite import bench_dir
from pystronghold.models import GPT
from pystronghold.train import autowindow

SCRIPT = str(bench_dir() / "gpu_train.py")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600,
                          cwd=bench_dir().parent)


def test_cpu_subset_records_equal_losses(tmp_path):
    out = tmp_path / "gpu_train.json"
    proc = run("--device", "cpu", "--model", "tiny", "--steps", "2", "--warmup", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(out.read_text())
    records = {r["config"]: r for r in payload["records"]}
    assert list(records) == ["plain", "recompute", "W=all", "W=4", "W=2", "W=auto"]
    assert set(payload["skipped"]) == {"fsdp2-offload", "deepspeed-zero2"}
    plain = torch.tensor(records["plain"]["losses"])
    assert len(plain) == 2 and torch.isfinite(plain).all()
    for name, r in records.items():
        # fp32 on the CPU: every way computes the same training (tolerance: summation order of the
        # fused CPU Adam against torch's)
        torch.testing.assert_close(torch.tensor(r["losses"]), plain, rtol=1e-5, atol=0, msg=name)
        assert r["losses_ok"] and r["max_rel_loss_diff"] <= payload["loss_rtol"]
        assert r["step_ms"] > 0 and r["tflops"] > 0 and r["host_peak_GiB"] > 0
    assert records["W=2"]["W"] == 2 and records["W=all"]["W"] == 4 and 1 <= records["W=auto"]["W"] <= 4
    assert records["W=2"]["K"] == 0 and records["plain"]["K"] == "-" and 0 <= records["W=auto"]["K"] <= 4
    # tokens * (6 N + 12 L h T) for the tiny preset (hidden 64, MLP 256, vocabulary 256, 4 blocks):
    # a block is 2 norms (256) + qkv (12,480) + proj (4,096) + fc1 (16,640) + fc2 (16,384) + 2 biases (128)
    n = 4 * 49_984 + 256 * 64
    assert payload["flops_per_step"] == 2 * 64 * (6 * n + 12 * 4 * 64 * 64)
    assert "LOSS MISMATCH" not in proc.stdout


def test_fsdp2_code_path_named_on_cpu_gives_plain_losses(tmp_path):
    out = tmp_path / "fsdp.json"
    proc = run("--device", "cpu", "--steps", "2", "--warmup", "1", "--configs", "fsdp2-offload", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["config"]: r for r in json.loads(out.read_text())["records"]}
    assert list(records) == ["plain", "fsdp2-offload"]
    torch.testing.assert_close(torch.tensor(records["fsdp2-offload"]["losses"]),
                               torch.tensor(records["plain"]["losses"]), rtol=1e-5, atol=0)


def test_bad_config_name_is_one_line_error():
    proc = run("--device", "cpu", "--configs", "plain,W=3")
    assert proc.returncode == 2 and "--configs" in proc.stderr and "W=3" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_one_clear_line():
    proc = run("--steps", "1")
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()] and "no CUDA device" in proc.stdout


def _load_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(bench_dir()))
    spec = importlib.util.spec_from_file_location("gpu_train_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_failing_configuration_is_reported_and_the_others_still_measured(tmp_path, monkeypatch, capsys):
    bench = _load_bench(monkeypatch)

    def out_of_memory(model, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench, "auto_split", out_of_memory)
    out = tmp_path / "partial.json"
    code = bench.main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--configs", "W=auto,W=2",
                       "--json", str(out)])
    assert code == 1
    payload = json.loads(out.read_text())
    assert [r["config"] for r in payload["records"]] == ["plain", "W=2"]
    assert payload["failed"] == {"W=auto": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert "!!! W=auto FAILED" in capsys.readouterr().out


def test_a_run_killed_midway_keeps_the_configurations_it_finished(tmp_path, monkeypatch):
    """A lent GPU's stage timeout kills the run: the JSON written after each configuration keeps
    the rows finished so far, marked incomplete."""
    bench = _load_bench(monkeypatch)
    run_config = bench.run_config

    def killed_at_the_second(name, *args, **kwargs):
        if name != "plain":
            raise KeyboardInterrupt  # not an Exception: nothing in the script catches it, like SIGKILL
        return run_config(name, *args, **kwargs)

    monkeypatch.setattr(bench, "run_config", killed_at_the_second)
    out = tmp_path / "killed.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--configs", "plain,W=2", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert [r["config"] for r in payload["records"]] == ["plain"] and payload["complete"] is False


def test_auto_row_wraps_the_split_train_window_auto_chooses(monkeypatch):
    """W=auto wraps K resident blocks, their recompute and W as ``choose_runtime_window`` gives them
    (the planner's decision is made up here: K = 2 recomputing, W = 1)."""
    bench = _load_bench(monkeypatch)
    args, cfg = bench.parse_args(["--device", "cpu", "--steps", "1", "--warmup", "0"])
    given = []

    def decide(model, config):
        given.append(config)
        return autowindow.AutoWindow(window=1, max_window=2, budget_bytes=0, costs=None,
                                     step=types.SimpleNamespace(total_s=0.25),
                                     resident_blocks=2, resident_recompute=True, blocks=cfg.layers)

    monkeypatch.setattr(autowindow, "choose_runtime_window", decide)
    trainer = bench.make_trainer("W=auto", GPT(cfg, seed=0), args, torch.device("cpu"))
    try:
        stats = trainer.engine.stats()
        assert (stats["resident_blocks"], trainer.engine.window_size) == (2, 1)
        assert trainer.engine.config.resident_recompute
        assert (trainer.resident_blocks, trainer.window, trainer.resident_recompute) == (2, 1, True)
        assert trainer.predicted_step_s == 0.25  # the planner's step, for the predicted-vs-measured row
    finally:
        trainer.close()
    run, = given  # the run's shapes and precision, without clipping (the bench does not clip)
    assert (run.config.data.batch, run.seq, run.runtime.precision) == (args.batch, args.seq, args.precision)
    assert run.runtime.window == "auto" and run.runtime.clip_grad_norm is None



def test_a_failing_process_group_costs_only_its_own_configuration(tmp_path, monkeypatch):
    """The one-rank group FSDP2 and DeepSpeed need is set up inside the configuration's guard: on the
    H100 a failing set-up there lost plain's, W=2's and W=auto's figures with it."""
    bench = _load_bench(monkeypatch)

    def no_group(device):
        raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")

    monkeypatch.setattr(bench, "init_single_rank", no_group)
    out = tmp_path / "partial.json"
    code = bench.main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--configs", "plain,fsdp2-offload",
                       "--json", str(out)])
    payload = json.loads(out.read_text())
    assert code == 1 and [r["config"] for r in payload["records"]] == ["plain"]
    assert payload["failed"]["fsdp2-offload"].startswith("ValueError: Expected a torch.device")


def test_single_rank_group_names_the_device_by_index(monkeypatch):
    """torch.cuda.set_device refuses torch.device('cuda') without an index (torch 2.11 on the H100):
    the group's device is the current one then."""
    import torch.distributed as dist

    bench = _load_bench(monkeypatch)
    chosen = []

    def set_device(device):
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        chosen.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: chosen.append(kwargs["backend"]))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # set by the call: undone after the test
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    bench.init_single_rank(torch.device("cuda"))
    bench.init_single_rank(torch.device("cuda", 1))
    assert chosen == [3, "cpu:gloo,cuda:nccl", 1, "cpu:gloo,cuda:nccl"]
