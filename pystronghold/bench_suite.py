"""``pystronghold bench [NAMES]``: run the ``bench/`` scripts that apply here, one table of ratios.

Each script checks correctness, measures its own baseline in the same run, taking turns with it
(paired timing, ``bench/common.py``), and writes its records with ``--json``, each with the load
average at its start and end; this runner only starts them (``--quick`` unless ``--full``), reads the
records and pulls one headline ratio out of each (``HEADLINES``): the median of the paired ratios with
its p20-p80 spread, and the load during the script (LOADED when it exceeded the core count).
Scripts that do not exist in this checkout or do not apply to this machine are listed as skipped
with the reason. See bench/README.md for what each measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["BENCHES", "HEADLINES", "bench_dir", "headline", "load_label", "add_bench_command"]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


Spread = tuple  # (p20, p80) of a paired ratio; None where the script gives none (GPU kernels)


def _spread(rec: dict, key: str) -> Spread:
    return (rec[key + "_p20"], rec[key + "_p80"]) if key + "_p20" in rec else None


def _inverse(rec: dict, key: str) -> tuple[float, Spread]:
    """1 / a time ratio (slowdown -> speed-up) with its spread, whose ends swap."""
    lo_hi = _spread(rec, key)
    return 1.0 / rec[key], (1.0 / lo_hi[1], 1.0 / lo_hi[0]) if lo_hi else None


def _adam(records: list[dict]) -> tuple[str, float, Spread, str]:
    ours = [r for r in records if r["case"] == "ours" and r.get("tensors") == 1 and "x_torch_fused" in r]
    r = max(ours, key=lambda r: r["params_m"])
    return (f"fused CPU Adam at {r['params_m']:g}M params", r["x_torch_fused"], _spread(r, "x_torch_fused"),
            "torch.optim.AdamW(fused=True)")


def _copy(records: list[dict]) -> tuple[str, float, Spread, str]:
    eng = [r for r in records if r["kind"] == "host->host" and r["method"].startswith("engine")]
    r = max(eng, key=lambda r: (r["size_mib"], r["ratio"]))
    return f"copy engine host->host {r['size_mib']} MiB ({r['method']})", r["ratio"], _spread(r, "ratio"), "one memcpy"


def _window(records: list[dict]) -> tuple[str, float, Spread, str]:
    windowed = [r for r in records if r["config"].startswith("W=") and r["config"] != "W=all"]
    r = min(windowed, key=lambda r: int(r["config"][2:]))
    ratio, spread = _inverse(r, "vs_plain")
    return (f"{r['config']} step time ({100 * r['bytes_vs_plain']:.0f}% of plain's device bytes)", ratio, spread,
            "plain PyTorch, all resident")


def _gpu_train(records: list[dict]) -> tuple[str, float, Spread, str]:
    # NOTE: unpaired (no spread): each configuration trains in turn from a fresh model, since the
    # device cannot hold all of them at once; its vs_plain is a ratio of medians.
    plain = next(r for r in records if r["config"] == "plain")
    windowed = [r for r in records if r["config"].startswith("W=") and r["config"] not in ("W=all", "W=auto")
                and r["losses_ok"]]
    r = min(windowed, key=lambda r: int(r["config"][2:]))
    share = (f", {100 * r['device_peak_GiB'] / plain['device_peak_GiB']:.0f}% of its peak device memory"
             if isinstance(r["device_peak_GiB"], float) and isinstance(plain["device_peak_GiB"], float) else "")
    ratio, spread = _inverse(r, "vs_plain")
    return (f"GPU training, pystronghold {r['config']} step time ({r['tflops']:.0f} TFLOP/s{share})",
            ratio, spread, "plain PyTorch resident (autocast, fused AdamW)")


def _kernels(records: list[dict]) -> tuple[str, float, Spread, str]:
    if any(r.get("impl") == "reference" for r in records):
        ref = [r for r in records if r.get("impl") == "reference"]
        spread = ((_geomean([r["speedup_p20"] for r in ref]), _geomean([r["speedup_p80"] for r in ref]))
                  if all("speedup_p20" in r for r in ref) else None)
        return (f"CPU reference paths, geomean of {len(ref)} ops (fwd+bwd)", _geomean([r["speedup"] for r in ref]),
                spread, "naive unfused torch")
    fused = {r["op"]: r["fwdbwd_ms"] for r in records if r.get("impl") == "fused"}
    naive = {r["op"]: r["fwdbwd_ms"] for r in records if r.get("impl") == "unfused"}
    ratios = [naive[k] / fused[k] for k in fused if k in naive]
    return f"Triton fused ops, geomean of {len(ratios)} ops (fwd+bwd)", _geomean(ratios), None, "unfused torch"


def _parallel(records: list[dict]) -> tuple[str, float, Spread, str]:
    r = max(records, key=lambda r: (r["procs"], r["dp"]))
    ratio, spread = _inverse(r, "vs_1x1")
    return (f"TP={r['tp']} x DP={r['dp']} step time (gloo on CPU, {r['procs']} processes)", ratio, spread,
            "TP=1 x DP=1, one process")


def _nvme(records: list[dict]) -> tuple[str, float, Spread, str]:
    step = next(r for r in records if r["what"] == "step time, states on disk")
    tier = {r["what"]: r for r in records if r["kind"] == "tier"}
    write = tier["tier write during training"]["ratio"]
    read = tier["tier read during training"]["ratio"]
    ratio, spread = _inverse(step, "ratio")
    return (f"step time, every state on disk (tier at {100 * write:.0f}% of raw write, {100 * read:.0f}% of "
            f"raw read)", ratio, spread, "states in host memory")


HEADLINES = {"adam": _adam, "copy_engine": _copy, "window": _window, "gpu_train": _gpu_train, "kernels": _kernels,
             "parallel": _parallel, "nvme": _nvme}
"""name -> records -> (what, speed-up over the baseline (>1: faster), its (p20, p80) or None, baseline)."""


def load_label(records: list[dict]) -> str:
    """The load over a script's records: lowest start to highest end, LOADED when any record was
    marked loaded (load above the core count); "?" when the records carry no load."""
    starts = [r["load_start"] for r in records if "load_start" in r]
    ends = [r["load_end"] for r in records if "load_end" in r]
    if not starts:
        return "?"
    return f"{min(starts):.1f}-{max(ends):.1f}" + (" LOADED" if any(r.get("loaded") for r in records) else "")


def _kernel_args() -> list[str]:
    import torch

    return [] if torch.cuda.is_available() else ["--cpu-reference", "--threads", "1"]


BENCHES = {"adam": lambda: [], "copy_engine": lambda: [], "window": lambda: [], "gpu_train": lambda: [],
           "kernels": _kernel_args,
           "parallel": lambda: [], "nvme": lambda: []}
"""Script names in run order and the extra arguments each gets on this machine."""


def bench_dir() -> Path:
    """The checkout's bench/ folder (next to the pystronghold package)."""
    return Path(__file__).resolve().parent.parent / "bench"


def headline(name: str, payload: dict) -> tuple[str, float, Spread, str]:
    """(what, ratio vs baseline, (p20, p80) or None, baseline) from a script's JSON; KeyError/ValueError
    if it has none."""
    return HEADLINES[name](payload["records"])


def run_bench(args: argparse.Namespace) -> int:
    """Run ``pystronghold bench``: 0 when every selected script ran, 1 when one failed, 2 on bad input."""
    names = args.names or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"pystronghold bench: error: unknown benchmark(s) {unknown}; known: {', '.join(BENCHES)}",
              file=sys.stderr)
        return 2
    root = bench_dir()
    if not root.is_dir():
        print(f"pystronghold bench: error: no bench/ folder at {root} (run from a source checkout)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, failed = [], False
    from tqdm import tqdm

    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for name in tqdm(names, desc="bench", unit="script", file=sys.stderr, disable=args.quiet_progress):
        script = root / f"{name}.py"
        if not script.exists():
            rows.append((name, "skipped: no bench/%s.py in this checkout" % name, "", "", ""))
            continue
        record = out / f"{name}.json"
        record.unlink(missing_ok=True)
        cmd = [sys.executable, str(script), *BENCHES[name](), *([] if args.full else ["--quick"]),
               "--json", str(record)]
        t0 = time.perf_counter()
        with open(out / f"{name}.log", "w") as logf:
            proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=root.parent, env=env)
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            failed = True
            rows.append((name, f"FAILED (exit {proc.returncode}; see {out / (name + '.log')})", "", "",
                         f"{took:.0f} s"))
            continue
        if not record.exists():  # the script decided it does not apply here (e.g. no GPU)
            rows.append((name, "skipped: " + (out / f"{name}.log").read_text().strip().splitlines()[-1][:90], "",
                         "", f"{took:.0f} s"))
            continue
        payload = json.loads(record.read_text())
        what, ratio, spread, base = headline(name, payload)
        ratio_text = f"{ratio:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else " (unpaired)")
        rows.append((name, f"{what} vs {base}", ratio_text, load_label(payload["records"]), f"{took:.0f} s"))
    header = ("bench", "headline (vs baseline measured in the same run, taking turns)", "speed-up (p20-p80)",
              "load", "took")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if any("LOADED" in r[3] for r in rows):
        print(f"LOADED: the load average exceeded the {os.cpu_count()} cores while that script ran; its figures "
              "are not those of a quiet machine")
    print(f"records: {out}/<name>.json, logs: {out}/<name>.log")
    return 1 if failed else 0


def add_bench_command(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``pystronghold`` subcommands."""
    parser = subparsers.add_parser(
        "bench", help="run the bench/ scripts that apply here; one table of ratios vs their baselines",
        epilog="examples:\n  pystronghold bench                 # every script, --quick\n"
               "  pystronghold bench adam copy_engine --full --out bench/results",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHES)} (default: all)")
    parser.add_argument("--full", action="store_true", help="the scripts' full sizes instead of --quick")
    parser.add_argument("--out", default="bench/results", help="folder for the JSON records and logs (default: bench/results)")
    parser.add_argument("--quiet-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run_bench)
    return parser
