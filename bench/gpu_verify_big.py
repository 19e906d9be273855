"""The ``big`` suite's training stages of bench/gpu_verify.py: gpt3-6.7b through ``pystronghold train
--device cuda --window auto --nvme`` (the tiny preset on the CPU in the dry run), and what each
reports: the store-fill phases, the split the planner chose and its predicted step beside the
measured one, step time over a multi-step logging interval and model TFLOP/s, device peak, host
peak RSS, whether the loss falls, and (the stage without clipping) clipping's cost. Then, on a
device of 139 GiB, the largest full fine-tune of at least 13B (gpt3-13b's width, more layers when
they fit) that the planner fits in memory and in the stage's time left. Between them, gpt3-6.7b's
shape at 64K tokens a sample with train's long-context defaults."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from stage_runner import ROOT, Command, CommandRun, Context, StageResult, Target

STORE_LINE = re.compile(r"store ready in .*")
SPLIT_LINE = re.compile(r"window=auto: .*")
PREDICTED = re.compile(r"predicted step ([\d.]+) ms")
BIG_STEPS, BIG_LOG_EVERY = 8, 4
"""The 6.7B runs: 8 steps, timed over the second logging interval (steps 5-8)."""


def big_train(batch: int, clip: float) -> tuple[Callable, Callable]:
    """(commands, summarize) of one stage: ``pystronghold train`` at ``batch``, clipping at ``clip``
    (0: none)."""
    tag = f"b{batch}{'' if clip else '-noclip'}"

    def metrics_path(ctx: Context) -> Path:
        return ctx.work / f"metrics-{tag}.jsonl"

    def commands(ctx: Context) -> list[Command]:
        nvme = ctx.work / f"nvme-{tag}"
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        metrics = metrics_path(ctx)
        metrics.unlink(missing_ok=True)
        # NOTE: timed over steps 5-8 (one logging interval): a log drains nothing but the device, so
        # the host updates of one step overlap the next forward as in a long run
        common = ["--window", "auto", "--clip", str(clip), "--nvme", str(nvme), "--steps", str(BIG_STEPS),
                  "--log-every", str(BIG_LOG_EVERY), "--eval-every", "0", "--eval-batches", "1", "--quiet",
                  "--metrics-file", str(metrics), "--max-bytes", "2000000"]
        if ctx.dry:
            size = ["--model", "tiny", "--device", "cpu", "--precision", "fp32", "--seq", "64",
                    "--batch", str(batch), "--nvme-states", "all"]
        else:
            # NOTE: a tenth of the preset's peak LR: the warm-up is squeezed into the 8 steps, and on
            # the H100 (2026-11-26) the preset's 1.2e-4 (2e-5 at step 1) sent the loss 10.5 -> 31.5 at
            # step 2 at b4 and b16 alike (Adam's first steps move every weight by about the LR at once)
            size = ["--model", "gpt3-6.7b", "--device", "cuda", "--precision", "bf16", "--seq", "2048",
                    "--batch", str(batch), "--lr", "1.2e-5"]
        return [Command([ctx.python, "-m", "pystronghold", "train", *size, *common], label=f"train {tag}")]

    def summarize(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
        if not runs:
            return
        out = runs[-1].output
        store, split = STORE_LINE.search(out), SPLIT_LINE.search(out)
        if store:
            result.figures.append(store.group(0))
            secs = re.match(r"store ready in ([\d.]+) s", store.group(0))
            if secs and not ctx.dry:
                result.targets.append(Target(f"6.7B {tag}: store ready", f"{float(secs.group(1)):.1f} s", "<= 30 s",
                                             float(secs.group(1)) <= 30))
        if split:
            result.figures.append(split.group(0)[:400])
        metrics = metrics_path(ctx)
        lines = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.exists() else []
        intervals = [m for m in lines if "ms_per_step" in m]
        result.data = {"intervals": intervals, "store": store.group(0) if store else None,
                       "split": split.group(0) if split else None, "host_peak_rss_bytes": runs[-1].max_rss_bytes}
        result.figures.append(f"host peak RSS {runs[-1].max_rss_bytes / 2**30:.1f} GiB")
        if not intervals:
            result.errors.append("no metrics line: the run made no step")
            return
        # the last interval (steps 5-8): the first holds the warm-up of the allocator and the store
        timed = intervals[-1]
        step_ms = timed["ms_per_step"]
        losses = [m["loss"] for m in intervals]
        peak = max(m["device_peak_bytes"] for m in intervals)
        per_sequence = _flops_per_sequence(ctx.python, *(("tiny", 64) if ctx.dry else ("gpt3-6.7b", 2048)))
        flops = None if per_sequence is None else batch * per_sequence
        result.data.update(step_ms=step_ms, losses=losses, device_peak_bytes=peak, flops_per_step=flops)
        tflops = flops / (step_ms / 1e3) / 1e12 if flops else None
        first = timed["step"] - timed.get("loss_steps", 1) + 1
        result.figures.append(f"{timed['step']} steps: {step_ms:.0f} ms/step over steps {first}-{timed['step']}"
                              + (f", {tflops:.1f} model TFLOP/s" if tflops else "")
                              + f", device peak {peak / 2**30:.2f} GiB, mean losses of the intervals "
                              + " ".join(f"{x:.3f}" for x in losses))
        falls = losses[-1] < losses[0]
        result.targets.append(Target(f"6.7B {tag}: the loss falls", f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                                     "last interval < first", falls))
        if not falls:
            result.status = "fail" if result.status == "pass" else result.status
            result.errors.append(f"the loss did not fall: {losses}")
        predicted = PREDICTED.search(split.group(0)) if split else None
        if predicted:
            err = abs(float(predicted.group(1)) / step_ms - 1)
            result.data["predicted_step_ms"] = float(predicted.group(1))
            result.targets.append(Target(f"planner 6.7B {tag}: |predicted / measured - 1|",
                                         f"{100 * err:.1f}% ({float(predicted.group(1)):.0f} vs {step_ms:.0f} ms)",
                                         "<= 10%", err <= 0.10 if not ctx.dry else None))
        if not clip:
            clip_cost(ctx, result)
        if ctx.dry:
            return
        if batch == 16 and tflops:
            result.targets.append(Target("6.7B b16: model TFLOP/s", f"{tflops:.0f}", ">= 300", tflops >= 300))

    return commands, summarize


LONG_SEQ, LONG_STEPS = 65536, 2
"""The long-context stage: gpt3-6.7b's shape at 64K tokens a sample, 2 steps, timed over the second."""
LONG_LINES = re.compile(r"(long context: .*|MLP: .*|seq: .*)")


def long_context_train() -> tuple[Callable, Callable]:
    """(commands, summarize) of the stage that trains gpt3-6.7b's shape (its positions raised to
    ``LONG_SEQ``) at batch 1 with the defaults of ``train``: the chunked loss and MLP tiles by
    their rules, head/tail and input offload as the planner chooses (the dry run: the tiny shape
    at 256 tokens on the CPU)."""

    def commands(ctx: Context) -> list[Command]:
        nvme = ctx.work / "nvme-long"
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        metrics = ctx.work / "metrics-long.jsonl"
        metrics.unlink(missing_ok=True)
        seq = 256 if ctx.dry else LONG_SEQ
        shape = ({"vocab_size": 256, "layers": 4, "hidden": 64, "heads": 4} if ctx.dry else
                 {"vocab_size": 50257, "vocab_pad_multiple": 128, "layers": 32, "hidden": 4096, "heads": 32,
                  "tie_embeddings": True})
        model = ctx.work / "long-model.json"
        model.write_text(json.dumps({**shape, "seq_len": seq}))
        where = (["--device", "cpu", "--precision", "fp32"] if ctx.dry else
                 ["--device", "cuda", "--precision", "bf16", "--lr", "1.2e-5"])
        return [Command([ctx.python, "-m", "pystronghold", "train", "--model", str(model), *where, "--seq", str(seq),
                         "--batch", "1", "--window", "auto", "--clip", "1", "--nvme", str(nvme),
                         "--steps", str(LONG_STEPS), "--log-every", "1", "--eval-every", "0", "--eval-batches", "1",
                         "--val-fraction", "0.2", "--quiet", "--metrics-file", str(metrics),
                         "--max-bytes", str(8 * seq)], label=f"train 6.7B shape at {seq} tokens")]

    def summarize(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
        if not runs:
            return
        out = runs[-1].output
        result.figures.extend(m.group(0)[:300] for m in LONG_LINES.finditer(out))
        split = SPLIT_LINE.search(out)
        if split:
            result.figures.append(split.group(0)[:400])
        metrics = ctx.work / "metrics-long.jsonl"
        intervals = [m for m in (json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip())
                     if "ms_per_step" in m] if metrics.exists() else []
        result.data.update(intervals=intervals, host_peak_rss_bytes=runs[-1].max_rss_bytes)
        if not intervals:
            result.errors.append("no metrics line: the run made no step")
            return
        last, seq = intervals[-1], 256 if ctx.dry else LONG_SEQ
        peak = max(m["device_peak_bytes"] for m in intervals)
        result.data.update(step_ms=last["ms_per_step"], device_peak_bytes=peak)
        result.figures.append(f"{seq} tokens: {last['ms_per_step']:.0f} ms/step at step {last['step']} "
                              f"({seq / (last['ms_per_step'] / 1e3):.0f} tokens/s), device peak {peak / 2**30:.2f} GiB, "
                              f"host peak RSS {runs[-1].max_rss_bytes / 2**30:.1f} GiB")
        predicted = PREDICTED.search(split.group(0)) if split else None
        if predicted:
            result.data["predicted_step_ms"] = float(predicted.group(1))
            result.targets.append(Target(f"6.7B at {seq} tokens: predicted / measured step",
                                         f"{float(predicted.group(1)) / last['ms_per_step']:.2f}", "0.9-1.1",
                                         None if ctx.dry else abs(float(predicted.group(1)) / last["ms_per_step"] - 1) <= 0.1))
        result.targets.append(Target("6.7B trains at >= 64K tokens on one GPU", f"{seq} tokens, {len(intervals)} steps",
                                     "a step completes", None if ctx.dry else seq >= 65536))

    return commands, summarize


MODEL_FLOPS = """
import sys
sys.path.insert(0, "bench")
from gpu_train import model_flops_per_step
from pystronghold.train.model_spec import resolve_model
print(model_flops_per_step(resolve_model(sys.argv[1]), 1, int(sys.argv[2])))
"""


@functools.lru_cache(maxsize=None)
def _flops_per_sequence(python: str, model: str, seq: int) -> float | None:
    """Model FLOPs of one sequence's step as bench/gpu_train.py counts them (linear in the batch),
    from a child Python (the driver imports no torch); asked once per model, not once per stage."""
    try:
        done = subprocess.run([python, "-c", MODEL_FLOPS, model, str(seq)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        return float(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None



def clip_cost(ctx: Context, result: StageResult) -> None:
    """The b16 step with clipping against this stage's without (the target: at most 1.10x)."""
    name = "6.7B b16: clipping / no clipping step time"
    clip = next((r for r in ctx.results if r.name == "train-6.7b-b16"), None)
    if clip is None or "step_ms" not in clip.data or "step_ms" not in result.data:
        result.targets.append(Target(name, "not measured", "<= 1.10x", None))
        return
    ratio = clip.data["step_ms"] / result.data["step_ms"]
    result.figures.append(f"clipping costs {ratio:.2f}x the step without it")
    result.targets.append(Target(name, f"{ratio:.2f}x", "<= 1.10x", None if ctx.dry else ratio <= 1.10))


# ---- the largest full fine-tune the planner fits

@functools.lru_cache(maxsize=1)
def _gpt3_13b() -> dict:
    """gpt3-13b's GPTConfig fields (as in pystronghold/models/presets.py: the driver imports no torch)."""
    return {"vocab_size": 50257, "vocab_pad_multiple": 128, "seq_len": 2048, "layers": 40, "hidden": 5120,
            "heads": 40, "tie_embeddings": True}


LARGEST_MIN_DEVICE_GIB = 130.0
"""The stage runs on a device of at least this (an H200's 139 GiB), else it says why it did not."""
LARGEST_STEPS, LARGEST_LOG_EVERY, LARGEST_BATCH = 4, 2, 4
STARTUP_S = 60.0
"""Seconds of a ``train`` run besides the store fill and the steps: imports, the data, the window's
probe of one block, the end (measured on the H100 about 35-50 s for 6.7B)."""
FILL_S_PER_PARAM = 4e-9
"""Store fill seconds per parameter when no 6.7B stage measured it (the H100: 24-27 s for 6.7B)."""
PLANNER_MARGIN = 1.25
"""The planner's step times are multiplied by this (it under-predicted by 16-20% on the H100)."""
GPT3_6B7_PARAMS = 6.66e9


def pick_layers(*, min_layers: int, fit_layers: int, step_s_at_fit: float, params_at, time_s: float,
                steps: int, fill_s_per_param: float) -> int:
    """The most layers, between ``min_layers`` and ``fit_layers`` (the most the planner fits in
    memory), whose ``train`` run of ``steps`` steps fits ``time_s`` seconds: start-up, the store fill
    (``fill_s_per_param`` x ``params_at(layers)``) and the steps (the planner's step at ``fit_layers``,
    ``step_s_at_fit``, scaled by the layers and ``PLANNER_MARGIN``). ``min_layers`` when none fits:
    the stage trains at least that."""
    for layers in range(max(fit_layers, min_layers), min_layers - 1, -1):
        step_s = step_s_at_fit * layers / max(fit_layers, 1) * PLANNER_MARGIN
        if STARTUP_S + fill_s_per_param * params_at(layers) + (steps + 1) * step_s <= time_s:
            return layers
    return min_layers


def _device_gib(python: str) -> float:
    code = ("import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30 "
            "if torch.cuda.is_available() else 0)")
    try:
        return float(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0.0


def _host_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def largest_train() -> tuple[Callable, Callable]:
    """(commands, summarize) of the stage that trains the largest full fine-tune of at least 13B:
    gpt3-13b's width, as many layers as ``pystronghold plan`` fits in this machine's device, host and
    disk and ``pick_layers`` in the stage's time. The dry run does the same with the tiny preset's
    width (on the CPU, a pretend device of 139 GiB, at most twice tiny's layers)."""

    def choice_path(ctx: Context) -> Path:
        return ctx.work / "largest.json"

    def commands(ctx: Context) -> list[Command]:
        choice: dict = {}
        choice_path(ctx).unlink(missing_ok=True)
        device_gib = 139.0 if ctx.dry else _device_gib(ctx.python)
        if device_gib < LARGEST_MIN_DEVICE_GIB:
            choice["skipped"] = (f"a device of {device_gib:.0f} GiB: the largest fine-tune runs on one of "
                                 f">= {LARGEST_MIN_DEVICE_GIB:.0f} GiB")
            choice_path(ctx).write_text(json.dumps(choice))
            return []
        base = {"vocab_size": 256, "seq_len": 64, "layers": 4, "hidden": 64, "heads": 4} if ctx.dry else _gpt3_13b()
        nvme = ctx.work / "nvme-largest"
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        host_gib, disk_gib = _host_available_gib(), max(0.0, shutil.disk_usage(nvme).free / 2**30 - 4)
        # NOTE: the dry run plans tiny blocks in a pretend machine just past the planner's reserves
        # (1 GiB device, 8 GiB host): a 139 GiB one would have it count a million layers
        memory = ("1.05", "8.02", "0") if ctx.dry else (f"{device_gib:.1f}", f"{host_gib:.1f}", f"{disk_gib:.1f}")
        seq = base["seq_len"]
        plan = [ctx.python, "-m", "pystronghold", "plan", "--gpu-memory", memory[0], "--gpu-tflops", "989",
                "--link-bandwidth", "50", "--host-memory", memory[1], "--nvme", memory[2],
                "--cpu-adam-rate", "4", "--hidden", str(base["hidden"]), "--heads", str(base["heads"]),
                "--layers", str(base["layers"]), "--vocab", str(base["vocab_size"]), "--seq", str(seq),
                "--batch", str(LARGEST_BATCH), "--precision", "bf16", "--overlap", "forward",
                "--widths", str(base["hidden"]), "--json"]
        done = subprocess.run(plan, cwd=ROOT, capture_output=True, text=True, timeout=300)
        record = json.loads(done.stdout)
        row = (record.get("largest") or [{}])[0]
        planner_layers = int(row.get("layers", 0))
        fit_layers = min(planner_layers, 2 * base["layers"]) if ctx.dry else planner_layers
        per_block = record["model"]["block_params_per_rank"]
        base_params = record["model"]["params"]

        def params_at(layers: int) -> float:
            return base_params + (layers - base["layers"]) * per_block

        fill = FILL_S_PER_PARAM
        measured = next((r for r in ctx.results if r.name == "train-6.7b-b16"), None)
        store = re.match(r"store ready in ([\d.]+) s", (measured.data.get("store") or "") if measured else "")
        if store and not ctx.dry:
            fill = float(store.group(1)) / GPT3_6B7_PARAMS
        layers = pick_layers(min_layers=base["layers"], fit_layers=fit_layers, step_s_at_fit=row.get("step_s") or 0.0,
                             params_at=params_at, time_s=ctx.time_left_s, steps=LARGEST_STEPS, fill_s_per_param=fill)
        choice.update(layers=layers, params=params_at(layers), planner_fit_layers=planner_layers,
                      planner_fit_params=row.get("params"), planner_bound=row.get("bound"),
                      planner_step_s=row.get("step_s"), planner_fits_min=bool(record.get("fits")),
                      device_gib=device_gib, host_gib=host_gib, disk_gib=disk_gib, time_s=ctx.time_left_s)
        choice_path(ctx).write_text(json.dumps(choice))
        model = ctx.work / "largest-model.json"
        model.write_text(json.dumps({**base, "layers": layers}))
        metrics = ctx.work / "metrics-largest.jsonl"
        metrics.unlink(missing_ok=True)
        where = (["--device", "cpu", "--precision", "fp32", "--nvme-states", "all"] if ctx.dry else
                 ["--device", "cuda", "--precision", "bf16", "--lr", "1e-5"])
        return [Command([ctx.python, "-m", "pystronghold", "train", "--model", str(model), *where, "--seq", str(seq),
                         "--batch", str(LARGEST_BATCH), "--window", "auto", "--clip", "1", "--nvme", str(nvme),
                         "--steps", str(LARGEST_STEPS), "--log-every", str(LARGEST_LOG_EVERY), "--eval-every", "0",
                         "--eval-batches", "1", "--quiet", "--metrics-file", str(metrics), "--max-bytes", "2000000"],
                        label=f"train {layers} x {base['hidden']} ({params_at(layers) / 1e9:.2f} B params)")]

    def summarize(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
        path = choice_path(ctx)
        choice = json.loads(path.read_text()) if path.exists() else {}
        result.data["choice"] = choice
        if "skipped" in choice:
            result.figures.append(f"not run: {choice['skipped']}")
            return
        if not choice:
            return
        result.figures.append(
            f"{choice['layers']} layers, {choice['params'] / 1e9:.3g} B params, in {choice['time_s']:.0f} s; the "
            f"planner fits {choice['planner_fit_layers']} layers ({(choice['planner_fit_params'] or 0) / 1e9:.3g} B, "
            f"bound by {choice['planner_bound']}) on {choice['device_gib']:.0f} GiB device, "
            f"{choice['host_gib']:.0f} GiB host, {choice['disk_gib']:.0f} GiB disk")
        result.targets.append(Target("largest full fine-tune the planner fits", f"{choice['planner_fit_params'] or 0:.3g}",
                                     ">= 13B params", None if ctx.dry else (choice["planner_fit_params"] or 0) >= 13e9))
        if not runs:
            return
        out = runs[-1].output
        for line in (STORE_LINE.search(out), SPLIT_LINE.search(out)):
            if line:
                result.figures.append(line.group(0)[:400])
        metrics = ctx.work / "metrics-largest.jsonl"
        intervals = [m for m in (json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip())
                     if "ms_per_step" in m] if metrics.exists() else []
        result.data.update(intervals=intervals, host_peak_rss_bytes=runs[-1].max_rss_bytes)
        result.figures.append(f"host peak RSS {runs[-1].max_rss_bytes / 2**30:.1f} GiB")
        if intervals:
            last = intervals[-1]
            result.figures.append(f"{last['step']} steps: {last['ms_per_step']:.0f} ms/step over the last "
                                  f"{last.get('loss_steps', 1)}, device peak {last['device_peak_bytes'] / 2**30:.2f} "
                                  f"GiB, mean losses of the intervals " + " ".join(f"{m['loss']:.3f}" for m in intervals))
        result.targets.append(Target(f"{choice['params'] / 1e9:.3g}B full fine-tune trains", f"{len(intervals)} "
                                     f"of {LARGEST_STEPS // LARGEST_LOG_EVERY} logging intervals",
                                     "every interval", len(intervals) == LARGEST_STEPS // LARGEST_LOG_EVERY))

    return commands, summarize
