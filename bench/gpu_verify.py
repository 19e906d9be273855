"""The prepared GPU verification: what a lent GPU runs first, in one command, into one report.

A GPU is lent for minutes (``../shared/GPU.md``), so what it runs is prepared here and kept working
by its CPU dry run. Each suite is a list of stages run in order, each under its own timeout and
each run even when an earlier one failed; every stage's output goes to ``log.txt`` and, after each
stage, ``REPORT.md`` (per stage: pass or fail, the figures, the first error lines, the time) and
``report.json`` (the same, with every benchmark's records) are rewritten, so a call cut short still
brings back what ran.

Suites, each in the order a call cut short should keep (``SUITE_BUDGET_S`` seconds by default):
  verify  env (nvidia-smi, versions); the CUDA build of ``_C``; the tests that need the device
          (``pytest -m gpu``: tests/gpu, the other CUDA tests, the Triton kernel tests);
          ``bench/gpu_train.py`` at gpt3-1.3b, bf16, 4 x 2048 (plain, W=auto, W=2), at batch 8
          (plain, W=auto), then the baselines at batch 4 with 2 steps (FSDP2 offload, DeepSpeed
          ZeRO-2 when it imports).
  big     env and build, then gpt3-6.7b through ``pystronghold train --device cuda --window auto
          --nvme DIR`` at batch 16 x 2048, 8 steps timed over the interval of steps 5-8 (--log-every
          4), with --clip 1 and then without clipping; on a device of 139 GiB, then the largest full
          fine-tune of at least 13B the planner fits in the time left (gpu_verify_big.py).
  extra   env and build, ``bench/kernels.py --quick``, ``bench/copy_engine.py --device cuda``, the
          store fill at gpt3-6.7b's block shape (no make target).

With ``--dry-run`` the same stages run on the CPU with the tiny preset and every stage shortened
(no CUDA build, no device); tests/bench/test_bench_gpu_verify.py runs both suites that way, so a broken
driver fails CI instead of wasting a lent GPU.

    make gpu-verify                       # python3 bench/gpu_verify.py verify --out build/gpu-report
    make gpu-verify-big                   # with $OUT set: the report in $OUT/gpu-verify-big
    make gpu-verify GPU_VERIFY_DRY=1      # the CPU dry run
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_verify_big import big_train, largest_train, long_context_train  # noqa: E402
from gpu_verify_extra import extra_stages  # noqa: E402
from stage_runner import (ROOT, Command, CommandRun, Context, Stage, StageResult, Target,  # noqa: E402
                          read_records, run_suite)

BENCH = ROOT / "bench"


def _device_name(python: str) -> str:
    code = ("import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "
            "f'no CUDA device (torch {torch.__version__})')")
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


# ---- the stages

VERSIONS = """
import platform, sys
print(f"versions: python {platform.python_version()}", end="")
try:
    import torch
    print(f", torch {torch.__version__}, CUDA {torch.version.cuda}, cudnn "
          f"{torch.backends.cudnn.version() if torch.cuda.is_available() else '-'}", end="")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f", device {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
              f"{torch.cuda.device_count()} visible)", end="")
except Exception as exc:
    print(f", torch: {type(exc).__name__}: {exc}", end="")
for name in ("triton", "transformers", "peft", "deepspeed"):
    try:
        module = __import__(name)
        print(f", {name} {getattr(module, '__version__', '?')}", end="")
    except Exception as exc:
        print(f", {name} -", end="")
print()
"""

BUILD_CHECK = """
import sys
from pystronghold._ext import native
info = native().build_info()
print("build_info:", info)
if sys.argv[1] == "cuda" and not info.get("with_cuda"):
    sys.exit("_C was built without CUDA")
"""


def env_commands(ctx: Context) -> list[Command]:
    # NOTE: `pystronghold info` runs at the end of the build stage: before `pip install -e .` the
    # package's kernels (installed from kernels/ through package_dir) are not importable
    cmds = [Command([ctx.python, "-c", VERSIONS], label="versions")]
    if shutil.which("nvidia-smi"):
        cmds.insert(0, Command(["nvidia-smi"], label="nvidia-smi"))
    elif not ctx.dry:
        cmds.insert(0, Command(["sh", "-c", "echo 'nvidia-smi: not on PATH'; exit 1"], label="nvidia-smi"))
    return cmds


def env_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    for run in runs:
        for line in run.output.splitlines():
            if line.startswith("versions:"):
                result.figures.append(line)
            if re.match(r"\| +\d+ +\S+ .*(On|Off) \|", line) or "Driver Version" in line:
                result.figures.append(line.strip(" |"))


def build_commands(ctx: Context) -> list[Command]:
    if ctx.dry:  # the CPU build (incremental: nothing to do after `make build`) and the check
        return [Command([ctx.python, "setup.py", "-q", "build_ext", "--inplace"], label="build_ext (CPU)"),
                Command([ctx.python, "-c", BUILD_CHECK, "cpu"], label="build check"),
                Command([ctx.python, "-m", "pystronghold", "info"], label="pystronghold info")]
    arch = ("import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    try:
        cap = subprocess.run([ctx.python, "-c", arch], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        cap = ""
    return [Command([ctx.python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation",
                     "--no-deps", "-e", "."], env={"PYSTRONGHOLD_NO_EXTENSION": "1"}, label="pip install -e ."),
            Command([ctx.python, "setup.py", "-q", "build_ext", "--inplace"],
                    env={"PYSTRONGHOLD_CUDA": "1", "TORCH_CUDA_ARCH_LIST": cap or "9.0",
                         "MAX_JOBS": str(os.cpu_count() or 4)}, label=f"build_ext (CUDA, arch {cap or '9.0'})"),
            Command([ctx.python, "-c", BUILD_CHECK, "cuda"], label="build check"),
            Command([ctx.python, "-m", "pystronghold", "info"], label="pystronghold info")]


def build_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    for run in runs:
        result.figures += [ln for ln in run.output.splitlines() if ln.startswith(("build_info:", "pystronghold: building"))]


def _has_xdist(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import xdist"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def tests_commands(ctx: Context) -> list[Command]:
    """tests/gpu alone first, one process; then all of ``-m gpu`` (tests/gpu again) in 8 processes
    sharing the device. NOTE: the shared device is the point: on the H100 (2026-11-26) a missing
    stream wait (a slot's zero fill against its first load) failed 11 exactness tests with 4
    processes on the device and none alone; the serial run tells such a race from a plain bug."""
    pytest = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-m", "gpu"]
    serial = [*pytest, f"--junitxml={ctx.work / 'tests-serial.xml'}", "--timeout", "120", "tests/gpu"]
    if ctx.dry:  # the selection must collect; the device tests themselves skip on the CPU
        return [Command([ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu",
                         "tests"], label="pytest --collect-only -m gpu tests"),
                Command(serial, label="pytest -m gpu tests/gpu")]
    parallel = ["-n", "8"] if _has_xdist(ctx.python) else []
    return [Command(serial, label="pytest -m gpu tests/gpu (one process)"),
            Command([*pytest, f"--junitxml={ctx.work / 'tests-parallel.xml'}", "--timeout", "150", *parallel,
                     "tests"], label=f"pytest -m gpu tests{' -n 8' if parallel else ''}")]


def tests_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    for run in runs:
        if "--collect-only" in run.argv:
            found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", run.output)
            result.figures.append(f"selection -m gpu collects {found.group(1) if found else '?'} tests")
    ran = 0
    for label, name in (("tests/gpu, one process", "tests-serial.xml"), ("-m gpu, all", "tests-parallel.xml")):
        xml = ctx.work / name
        if not xml.exists():
            continue
        suite = ET.parse(xml).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        ran += counts["tests"]
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        result.figures.append(f"{label}: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
                              f"{counts['skipped']} skipped")
        failed = []
        for case in suite.iter("testcase"):
            bad = case.find("failure")
            bad = bad if bad is not None else case.find("error")
            if bad is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:200]}")
        result.data[name] = {"counts": counts, "failed": failed}
        result.figures += [f"FAILED ({label}) {f}" for f in failed[:20]]
    if ran == 0:
        result.status = "fail"
        result.errors.append("no test ran")


# gpu_train: the configurations and the targets they judge
# NOTE: what matters most first, so a stage cut short keeps the targets' rows: W=auto right after
# plain; the baselines (FSDP2 offload took 4 s/step on the H100) in a stage of their own, last
TRAIN_RUNS = {
    # stage: (JSON, batch, configurations after plain, timed steps)
    "train-1.3b-b4": ("train_b4.json", 4, "W=auto,W=2", 5),
    "train-1.3b-b8": ("train_b8.json", 8, "W=auto", 5),
    "baselines-1.3b-b4": ("train_baselines.json", 4, "fsdp2-offload,deepspeed-zero2", 2),
}


def gpu_train_stage(stage: str):
    """(commands, summarize) of one ``bench/gpu_train.py`` stage of ``TRAIN_RUNS``."""
    json_name, batch, configs, steps = TRAIN_RUNS[stage]

    def commands(ctx: Context) -> list[Command]:
        script = [ctx.python, str(BENCH / "gpu_train.py"), "--configs", f"plain,{configs}",
                  "--json", str(ctx.work / json_name)]
        if ctx.dry:
            return [Command([*script, "--device", "cpu", "--steps", "2", "--warmup", "0", "--batch", str(batch // 2)],
                            label=f"gpu_train (CPU, tiny) b{batch // 2} {configs}")]
        return [Command([*script, "--model", "gpt3-1.3b", "--precision", "bf16", "--seq", "2048", "--batch", str(batch),
                         "--steps", str(steps), "--warmup", "2" if steps > 2 else "1"],
                        label=f"gpu_train gpt3-1.3b bf16 b{batch} plain,{configs}")]

    def summarize(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
        payload = read_records(ctx.work / json_name)
        result.data["records"] = payload.get("records", [])
        result.data["payload"] = payload
        train_rows(result, f"b{batch}", payload)
        step = {r["config"]: r["step_ms"] for r in payload.get("records", [])}
        if stage == "baselines-1.3b-b4":  # against the W=auto of the b4 stage
            b4 = next((r for r in ctx.results if r.name == "train-1.3b-b4"), None)
            auto = {r["config"]: r["step_ms"] for r in (b4.data.get("records", []) if b4 else [])}.get("W=auto")
            result.targets.append(_ratio_target("1.3B b4: W=auto speed / DeepSpeed ZeRO-2 offload",
                                                step.get("deepspeed-zero2"), auto, 3.0))
            result.targets.append(_ratio_target("1.3B b4: W=auto speed / FSDP2 CPUOffloadPolicy",
                                                step.get("fsdp2-offload"), auto, 10.0))
            return
        result.targets.append(_ratio_target(f"1.3B b{batch}: W=auto speed / plain", step.get("plain"),
                                            step.get("W=auto"), 0.90 if batch == 4 else 0.95))
        auto = next((r for r in payload.get("records", []) if r["config"] == "W=auto"), {})
        if auto.get("predicted_step_ms"):
            err = abs(auto["predicted_step_ms"] / auto["step_ms"] - 1)
            result.targets.append(Target(f"planner 1.3B b{batch}: |predicted / measured - 1|",
                                         f"{100 * err:.1f}%", "<= 10%", err <= 0.10))

    return commands, summarize


def _ratio_target(name: str, num: float | None, den: float | None, goal: float) -> Target:
    if not num or not den:
        return Target(name, "not measured", f">= {goal}x", None)
    ratio = num / den
    return Target(name, f"{ratio:.2f}x", f">= {goal}x", ratio >= goal)


def train_rows(result: StageResult, batch_label: str, payload: dict) -> None:
    """One figure per configuration of a ``gpu_train.py`` JSON (K and W with every row), and the
    configurations that failed or were skipped."""
    if payload and not payload.get("complete", True):
        result.figures.append(f"{batch_label}: cut short; the configurations it finished:")
    for r in payload.get("records", []):
        peak = r["device_peak_GiB"]
        result.figures.append(
            f"{batch_label} {r['config']}: {r['step_ms']:.1f} ms/step ({r['vs_plain']:.2f}x plain's time), "
            f"{r['tflops']:.1f} TFLOP/s, device peak {peak if isinstance(peak, str) else f'{peak:.1f}'} GiB, "
            f"host peak {r['host_peak_GiB']:.1f} GiB, losses {'ok' if r['losses_ok'] else 'DIFFER'}"
            + (f", K={r['K']} W={r['W']}" if r.get("K") not in (None, "-") else "")
            + (f", predicted {r['predicted_step_ms']:.1f} ms" if r.get("predicted_step_ms") else ""))
    for name, why in payload.get("failed", {}).items():
        result.figures.append(f"{batch_label} {name}: FAILED: {why}")
    for name, why in payload.get("skipped", {}).items():
        result.figures.append(f"{batch_label} {name}: skipped: {why}")


SUITE_BUDGET_S = {"verify": 420.0, "big": 330.0, "extra": 300.0}
"""Default seconds of each suite: a lent GPU has 15 minutes in all, its start (about a minute)
included, for ``make gpu-verify`` then ``make gpu-verify-big``."""


def suites() -> dict[str, list[Stage]]:
    env = Stage("env", "nvidia-smi, the versions of Python, torch, CUDA, triton and friends", 30, 10, env_commands,
                env_summary, dry_timeout_s=120)
    build = Stage("build", "the CUDA build of _C (pip install -e ., build_ext), pystronghold info", 150, 40,
                  build_commands, build_summary, dry_timeout_s=600)
    b16, b16_sum = big_train(16, 1.0)
    b16n, b16n_sum = big_train(16, 0.0)
    largest, largest_sum = largest_train()
    # NOTE: in the order a cut-short call should keep: the versions, the build, the tests, then the
    # rows the targets need most (1.3B b4 plain, W=auto, W=2; b8), the slow baselines last. On the
    # H100 (2026-11-26) FSDP2 ate the stage and the 1.3B rows were lost.
    return {
        "verify": [
            env, build,
            Stage("tests", "pytest -m gpu: tests/gpu alone, then with the CUDA and Triton kernel tests", 130, 60,
                  tests_commands, tests_summary, dry_timeout_s=300),
            Stage("train-1.3b-b4", "bench/gpu_train.py gpt3-1.3b bf16 4 x 2048: plain, W=auto, W=2", 120, 60,
                  *gpu_train_stage("train-1.3b-b4"), dry_timeout_s=300),
            Stage("train-1.3b-b8", "the same at batch 8: plain, W=auto", 80, 40, *gpu_train_stage("train-1.3b-b8"),
                  dry_timeout_s=300),
            Stage("baselines-1.3b-b4", "FSDP2 CPUOffloadPolicy and DeepSpeed ZeRO-2 offload at b4, --steps 2", 90, 30,
                  *gpu_train_stage("baselines-1.3b-b4"), dry_timeout_s=300),
        ],
        "big": [
            env, build,
            Stage("train-6.7b-b16", "pystronghold train gpt3-6.7b bf16 --window auto --clip 1 --nvme, 16 x 2048, "
                  "--steps 8 --log-every 4", 110, 80, b16, b16_sum, dry_timeout_s=300),
            Stage("train-6.7b-b16-noclip", "the same with --clip 0 (clipping's cost)", 100, 70, b16n, b16n_sum,
                  dry_timeout_s=300),
            Stage("train-6.7b-64k", "gpt3-6.7b's shape at 65,536 tokens a sample, batch 1, --window auto --clip 1, "
                  "train's long-context defaults, 2 steps", 130, 60, *long_context_train(), dry_timeout_s=300),
            Stage("train-largest", "on a device of 139 GiB: the largest full fine-tune (>= 13B) the planner fits "
                  "in the time left", 600, 60, largest, largest_sum, dry_timeout_s=300),
        ],
        # not in a make target: the kernels, the copy engine and the store fill, when a GPU has time to spare
        "extra": [env, build, *extra_stages()],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", choices=sorted(suites()))
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-report",
                        help="REPORT.md, report.json and log.txt go here (default build/gpu-report)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-verify-work",
                        help="scratch: benchmark JSON, the NVMe tier, junit XML")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny preset, every stage shortened")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole suite on the GPU (default: verify 420, big 330, extra 300: "
                             "both make targets and a machine's start fit a lent GPU's 15 minutes)")
    parser.add_argument("--stages", default=None, help="comma-separated subset of the suite's stages")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs the stages")
    parser.add_argument("--commit", default=None,
                        help="the commit to name in the report (a copied tree's git may not be the checkout's)")
    args = parser.parse_args(argv)
    stages = suites()[args.suite]
    if args.stages:
        wanted = args.stages.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            parser.error(f"--stages: {', '.join(unknown)} not in suite {args.suite} "
                         f"({', '.join(s.name for s in stages)})")
        stages = [s for s in stages if s.name in wanted]
    ctx = Context(dry=args.dry_run, out=args.out.resolve(), work=args.work.resolve(), python=args.python)
    budget = SUITE_BUDGET_S[args.suite] if args.budget is None else args.budget
    return run_suite(args.suite, stages, ctx, budget,
                     "CPU (dry run)" if ctx.dry else _device_name(ctx.python), commit=args.commit)


if __name__ == "__main__":
    sys.exit(main())
