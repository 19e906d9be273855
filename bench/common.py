"""Shared helpers of the benchmark scripts: timing with quantiles, machine facts, tables, JSON.

Every script measures its baseline in the same run and reports ratios; nothing here asserts a time.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Timing:
    """Seconds per call over `reps` timed repetitions (after warm-up)."""

    median_s: float
    p20_s: float
    p80_s: float
    reps: int
    samples_s: list = field(default_factory=list, repr=False)


def time_call(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20, min_time_s: float = 0.0) -> Timing:
    """Time `fn()` after `warmup` untimed calls: at least `reps` calls and at least `min_time_s` seconds."""
    for _ in range(warmup):
        fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return Timing(statistics.median(ordered), quantile(0.2), quantile(0.8), len(samples), samples)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_facts() -> dict:
    """CPU model, SIMD level of the build, threads, versions, commit and time, for JSON records."""
    import torch

    facts = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        from pystronghold._ext import native

        build = native().build_info()
        facts.update(simd=build["simd"], openmp_threads=build["openmp_max_threads"])
    except ImportError:
        facts.update(simd="unbuilt")
    return facts


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    """Print `rows` (dicts) as an aligned text table with the given column order."""
    if title:
        print(f"\n{title}")
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | os.PathLike | None, subject: str, records: list, extra: dict | None = None) -> None:
    """Write `records` with the machine facts to `path` (no-op when path is None)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"subject": subject, "machine": machine_facts(), **(extra or {}),
               "records": [asdict(r) if hasattr(r, "__dataclass_fields__") else r for r in records]}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def add_gpt_arguments(parser, *, layers: int, hidden: int, seq: int, steps: int, warmup: int) -> None:
    """The GPT shape and timing options the training benchmarks share (their defaults differ)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=warmup)
