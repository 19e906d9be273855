"""bench/gpu_verify.py, the prepared verification a lent GPU runs first: its stage runner (timeouts
that kill what a stage started, a failing stage that does not stop the next, the budget, the report)
and both suites' CPU dry runs through the make targets, so a broken driver fails here and not on
the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pystronghold.bench_suite import bench_dir

sys.path.insert(0, str(bench_dir()))
from stage_runner import Command, Context, Stage, run_suite  # noqa: E402

ROOT = bench_dir().parent


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _stage(name, code, *, timeout=30.0, floor=1.0, summarize=None):
    return Stage(name, f"the {name} stage", timeout, floor, lambda ctx: [Command(_python(code), label=name)],
                 summarize, dry_timeout_s=timeout)


def _report(ctx):
    return json.loads((ctx.out / "report.json").read_text()), (ctx.out / "REPORT.md").read_text()


def test_every_stage_runs_and_reports_failures_timeouts_and_figures(tmp_path):
    marker = tmp_path / "grandchild-alive"

    def figures(ctx, result, runs):
        result.figures.append(f"said {runs[0].output.strip()}")

    # the grandchild would write the marker after 4 s unless the timeout kills the whole group
    orphan = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              f"\"import time, pathlib; time.sleep(4); pathlib.Path({str(marker)!r}).write_text('x')\"]); "
              f"time.sleep(60)")
    stages = [_stage("first", "print(42)", summarize=figures),
              _stage("broken", "import sys; print('ValueError: the stage broke', file=sys.stderr); sys.exit(3)"),
              _stage("hangs", orphan, timeout=1.5),
              _stage("last", "print('still ran')", summarize=figures)]
    ctx = Context(dry=True, out=tmp_path / "out", work=tmp_path / "work", python=sys.executable)
    rc = run_suite("unit", stages, ctx, budget_s=1000, device="none")
    assert rc == 1
    report, markdown = _report(ctx)
    assert report["stages"][2]["commands"][0]["rc"] is None  # the hanging stage was killed at its timeout
    assert [(s["name"], s["status"]) for s in report["stages"]] == [
        ("first", "pass"), ("broken", "fail"), ("hangs", "timeout"), ("last", "pass")]
    assert report["status"] == "fail"
    broken = report["stages"][1]
    assert broken["commands"][0]["rc"] == 3
    assert any("ValueError: the stage broke" in e for e in broken["errors"])
    assert report["stages"][0]["figures"] == ["said 42"] and report["stages"][3]["figures"] == ["said still ran"]
    assert "| broken | FAIL |" in markdown and "| hangs | TIMEOUT |" in markdown and "said 42" in markdown
    log = (ctx.out / "log.txt").read_text()
    assert "ValueError: the stage broke" in log and "still ran" in log
    time.sleep(5)
    assert not marker.exists(), "the timed-out stage's grandchild outlived it"


def test_the_budget_holds_back_later_stages_floors_and_skips_what_does_not_fit(tmp_path):
    stages = [_stage("long", "import time; time.sleep(30)", timeout=100, floor=1),
              _stage("needs-two", "print('ran')", timeout=100, floor=2),
              _stage("needs-ten", "print('ran')", timeout=100, floor=10)]
    ctx = Context(dry=False, out=tmp_path / "out", work=tmp_path / "work", python=sys.executable)
    # budget 14 s: "long" may take 14 - (2 + 10) = 2 s; then about 12 s are left: "needs-two" runs,
    # "needs-ten" too (its floor fits); a budget of 5 s leaves "needs-ten" out
    run_suite("unit", stages, ctx, budget_s=14, device="none")
    report, _ = _report(ctx)
    assert [s["status"] for s in report["stages"]] == ["timeout", "pass", "pass"]
    assert report["stages"][0]["timeout_s"] == pytest.approx(2, abs=0.5)
    run_suite("unit", stages, ctx, budget_s=5, device="none")
    report, markdown = _report(ctx)
    assert [s["status"] for s in report["stages"]] == ["timeout", "pass", "skipped"]
    assert "budget" in report["stages"][2]["errors"][0]


def _make(target: str, tmp_path) -> tuple[subprocess.CompletedProcess, dict, str]:
    out = tmp_path / "report"
    proc = subprocess.run(["make", "-s", target, "GPU_VERIFY_DRY=1", f"GPU_PY={sys.executable}", f"GPU_OUT={out}",
                           f"GPU_WORK={tmp_path / 'work'}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return proc, report, (out / "REPORT.md").read_text() if (out / "REPORT.md").exists() else ""


def test_gpu_verify_dry_run_passes_every_stage_in_order(tmp_path):
    proc, report, markdown = _make("gpu-verify", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    stages = {s["name"]: s for s in report["stages"]}
    # what matters most lands first: the versions, the build, the tests, the 1.3B rows; the baselines last
    assert list(stages) == ["env", "build", "tests", "train-1.3b-b4", "train-1.3b-b8", "baselines-1.3b-b4"]
    assert all(s["status"] == "pass" for s in stages.values()) and report["dry_run"]
    assert any(f.startswith("versions: python") for f in stages["env"]["figures"])
    collected = [f for f in stages["tests"]["figures"] if f.startswith("selection -m gpu collects")]
    assert collected and int(collected[0].split()[4]) > 19  # tests/gpu and more
    b4 = [r["config"] for r in stages["train-1.3b-b4"]["data"]["records"]]
    assert b4 == ["plain", "W=auto", "W=2"]
    assert all(r["losses_ok"] for r in stages["train-1.3b-b4"]["data"]["records"])
    assert [r["config"] for r in stages["train-1.3b-b8"]["data"]["records"]] == ["plain", "W=auto"]
    baselines = stages["baselines-1.3b-b4"]["data"]["payload"]
    assert baselines["args"]["configs"] == ["plain", "fsdp2-offload", "deepspeed-zero2"]
    assert baselines["args"]["steps"] == 2 and "deepspeed-zero2" in baselines["skipped"]  # on the CPU
    assert any(t["name"].startswith("1.3B b4: W=auto speed / plain") and t["met"] is not None
               for t in stages["train-1.3b-b4"]["targets"])
    assert any(t["name"] == "1.3B b4: W=auto speed / FSDP2 CPUOffloadPolicy" and t["met"] is not None
               for t in stages["baselines-1.3b-b4"]["targets"])
    assert "# GPU verification: verify (CPU dry run)" in markdown and "## Targets" in markdown


def test_gpu_verify_big_dry_run_reports_the_training_figures_in_order(tmp_path):
    proc, report, markdown = _make("gpu-verify-big", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["env", "build", "train-6.7b-b16", "train-6.7b-b16-noclip", "train-6.7b-64k",
                            "train-largest"]
    assert all(s["status"] == "pass" for s in stages.values())
    for name in ("train-6.7b-b16", "train-6.7b-b16-noclip"):
        data = stages[name]["data"]
        # --steps 8 --log-every 4: timed over the second interval, steps 5-8
        assert [(m["step"], m["loss_steps"]) for m in data["intervals"]] == [(4, 4), (8, 4)]
        assert data["step_ms"] == data["intervals"][-1]["ms_per_step"] and data["losses"][-1] < data["losses"][0]
        assert data["store"].startswith("store ready in") and data["split"].startswith("window=auto:")
        assert data["predicted_step_ms"] > 0 and data["flops_per_step"] > 0 and data["host_peak_rss_bytes"] > 0
    assert any(t["name"].startswith("6.7B b16: clipping / no clipping") and t["measured"].endswith("x")
               for t in stages["train-6.7b-b16-noclip"]["targets"])
    long = stages["train-6.7b-64k"]
    assert len(long["data"]["intervals"]) == 2 and long["data"]["predicted_step_ms"] > 0
    assert any(f.startswith("256 tokens:") for f in long["figures"])
    largest = stages["train-largest"]["data"]
    assert largest["choice"]["layers"] >= 4 and largest["choice"]["planner_fit_layers"] >= 4  # tiny's 4 at least
    assert len(largest["intervals"]) == 2


def test_the_largest_fine_tune_takes_the_most_layers_its_time_allows():
    import gpu_verify_big as big

    def params_at(layers):
        return 1e9 * layers

    common = dict(min_layers=40, step_s_at_fit=10.0, params_at=params_at, steps=4, fill_s_per_param=1e-9)
    # at 50 layers: 60 start-up + 50 fill + 5 steps x 10 x 1.25 = 172.5 s
    assert big.pick_layers(fit_layers=50, time_s=173, **common) == 50
    assert big.pick_layers(fit_layers=50, time_s=160, **common) < 50
    # the planner fits fewer than the least, or the time is short: the least (13B) all the same
    assert big.pick_layers(fit_layers=32, time_s=1000, **common) == 40
    assert big.pick_layers(fit_layers=50, time_s=10, **common) == 40


def test_the_suites_fit_a_lent_gpu_and_write_into_out(tmp_path):
    import gpu_verify

    assert gpu_verify.SUITE_BUDGET_S["verify"] == 420 and gpu_verify.SUITE_BUDGET_S["big"] == 330
    for suite in ("verify", "big"):  # every stage is given at least its floor
        assert sum(s.floor_s for s in gpu_verify.suites()[suite]) <= gpu_verify.SUITE_BUDGET_S[suite]
    for target in ("gpu-verify", "gpu-verify-big"):
        dry = subprocess.run(["make", "-n", target, f"OUT={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert f"--out {tmp_path}/{target} " in dry.stdout, dry.stdout + dry.stderr


def test_the_gpu_commands_run_what_each_stage_is_for(tmp_path):
    """What the stages run on a GPU (not the dry run's sizes): 1.3B b4 plain, W=auto, W=2; b8 plain,
    W=auto; the baselines with 2 steps; 6.7B b16 for 8 steps logged every 4, with and without clipping."""
    import gpu_verify
    from gpu_verify_big import big_train

    ctx = Context(dry=False, out=tmp_path / "out", work=tmp_path / "work", python=sys.executable)
    ctx.work.mkdir()

    def argv(commands) -> str:
        (command,) = commands(ctx)
        return " ".join(command.argv)

    b4, b8, base = (argv(gpu_verify.gpu_train_stage(name)[0])
                    for name in ("train-1.3b-b4", "train-1.3b-b8", "baselines-1.3b-b4"))
    assert "--configs plain,W=auto,W=2 " in b4 and "--batch 4 " in b4 and "gpt3-1.3b" in b4
    assert "--configs plain,W=auto " in b8 and "--batch 8 " in b8
    assert "--configs plain,fsdp2-offload,deepspeed-zero2 " in base and "--steps 2 " in base
    for clip in (1.0, 0.0):
        big = argv(big_train(16, clip)[0])
        assert "gpt3-6.7b" in big and "--batch 16 " in big and f"--clip {clip} " in big
        assert "--steps 8 --log-every 4 " in big
