"""The ``extra`` suite's stages of bench/gpu_verify.py (no make target: what a GPU with time to spare
runs after ``verify`` and ``big``): ``bench/kernels.py --quick`` (Triton against SDPA and unfused
torch), ``bench/copy_engine.py --device cuda`` and the store fill at gpt3-6.7b's block shape."""

from __future__ import annotations

import os

from stage_runner import ROOT, Command, CommandRun, Context, Stage, StageResult, Target, read_records

BENCH = ROOT / "bench"


def kernels_commands(ctx: Context) -> list[Command]:
    script = [ctx.python, str(BENCH / "kernels.py"), "--quick", "--json", str(ctx.work / "kernels.json")]
    return [Command([*script, "--cpu-reference", "--threads", "1"] if ctx.dry else script, label="kernels --quick")]


def kernels_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    payload = read_records(ctx.work / "kernels.json")
    result.data["kernels"] = payload
    rows = payload.get("records", [])
    attention = {}
    for r in rows:
        if "N" in r:
            attention.setdefault((r["dtype"], r["N"], r["D"], r["causal"]), {})[r["impl"]] = r
    worst = None
    for shape, impls in attention.items():
        if "triton" in impls and "sdpa" in impls:
            ratio = impls["sdpa"]["fwdbwd_ms"] / impls["triton"]["fwdbwd_ms"]
            result.figures.append(f"attention {shape[0]} N={shape[1]} D={shape[2]} causal={shape[3]}: "
                                  f"triton {impls['triton']['fwdbwd_tflops']:.0f} TFLOP/s fwd+bwd, "
                                  f"{ratio:.2f}x SDPA")
            worst = ratio if worst is None else min(worst, ratio)
    if attention:
        result.targets.append(Target("Triton attention fwd+bwd / SDPA (worst shape)",
                                     "not measured" if worst is None else f"{worst:.2f}x", ">= 0.9x",
                                     None if worst is None else worst >= 0.9))
    fused = {}
    for r in rows:
        if "op" in r and "fwdbwd_ms" in r:
            fused.setdefault(r["op"], {})[r["impl"]] = r
    for op, impls in fused.items():
        if "fused" in impls and "unfused" in impls:
            ratio = impls["unfused"]["fwdbwd_ms"] / impls["fused"]["fwdbwd_ms"]
            result.figures.append(f"{op}: fused {ratio:.2f}x unfused torch (fwd+bwd)")
            result.targets.append(Target(f"fused {op} / unfused torch", f"{ratio:.2f}x", ">= 1.0x or dispatch "
                                         "to torch", ratio >= 1.0))
        elif "speedup" in next(iter(impls.values()), {}):
            for impl, r in impls.items():
                result.figures.append(f"{op} {impl} (CPU): {r['speedup']:.2f}x naive")


def copy_commands(ctx: Context) -> list[Command]:
    script = [ctx.python, str(BENCH / "copy_engine.py"), "--quick", "--json", str(ctx.work / "copy.json")]
    return [Command(script if ctx.dry else [*script, "--device", "cuda"], label="copy_engine --quick")]


def copy_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    payload = read_records(ctx.work / "copy.json")
    result.data["copy"] = payload
    for r in payload.get("records", []):
        rate = r.get("gb_s") or r.get("s_per_gib")
        unit = "GB/s" if r.get("gb_s") else "s/GiB"
        result.figures.append(f"{r.get('kind')} {r.get('size_mib')} MiB {r.get('method')}: "
                              f"{rate:.2f} {unit}" + (f", ratio {r['ratio']:.2f}" if r.get("ratio") else ""))


GPT3_6B7_LAYERS = 32


def fill_commands(ctx: Context) -> list[Command]:
    script = [ctx.python, str(BENCH / "store_fill.py"), "--reps", "1", "--json", str(ctx.work / "fill.json")]
    if ctx.dry:
        return [Command([*script, "--layers", "2", "--hidden", "128", "--heads", "4", "--threads", "1", "2"],
                        label="store_fill (CPU, 2 small blocks)")]
    threads = str(min(16, os.cpu_count() or 1))
    return [Command([*script, "--layers", "8", "--hidden", "4096", "--heads", "32", "--threads", "1", threads,
                     "--device", "cuda", "--precision", "bf16"], label="store_fill 8 blocks of gpt3-6.7b")]


def fill_summary(ctx: Context, result: StageResult, runs: list[CommandRun]) -> None:
    payload = read_records(ctx.work / "fill.json")
    result.data["fill"] = payload
    layers = payload.get("layers") or 1
    best = None
    for r in payload.get("records", []):
        result.figures.append(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        best = r["total s"] if best is None else min(best, r["total s"])
    if best is not None and not ctx.dry:
        whole = best * GPT3_6B7_LAYERS / layers
        result.targets.append(Target("6.7B store ready (8 blocks measured, scaled to 32)", f"{whole:.1f} s",
                                     "<= 30 s", whole <= 30))


def extra_stages() -> list[Stage]:
    return [Stage("kernels", "bench/kernels.py --quick", 45, 30, kernels_commands, kernels_summary, dry_timeout_s=300),
            Stage("copy-engine", "bench/copy_engine.py --device cuda --quick", 20, 10, copy_commands, copy_summary,
                  dry_timeout_s=300),
            Stage("store-fill", "bench/store_fill.py at gpt3-6.7b's block shape (8 blocks)", 90, 40, fill_commands,
                  fill_summary, dry_timeout_s=300)]
