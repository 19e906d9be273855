"""The planner's predicted step against the measured one, on this machine's backend.

Each configuration runs ``pystronghold train --window auto`` in a subprocess: before the first
step the planner measures one block, the LM head with the loss, the copies and both Adams, and
predicts the step (``train/autowindow.py``); the run then measures its steps. The table gives
predicted, the median measured step after the first ``--warmup`` steps (with its 20/80%
quantiles), and their ratio; the load over the runs. ``--json PATH`` writes the records with the
machine (``common.write_json``).

    PYTHONPATH=$PWD python bench/planner_step.py --data DIR [--steps 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, write_json  # noqa: E402

CONFIGS = {
    "mini b8 x 128, fp32": ["--model", "mini", "--batch", "8", "--seq", "128"],
    "mini b8 x 128, LoRA r8": ["--model", "mini", "--batch", "8", "--seq", "128", "--lora-rank", "8"],
    "small b4 x 256, fp32": ["--model", "small", "--batch", "4", "--seq", "256"],
}
"""Configurations: name -> ``train`` options."""


def run(name: str, options: list[str], data: str, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = [sys.executable, "-m", "pystronghold", "train", *options, "--data", data, "--steps", str(steps),
               "--window", "auto", "--log-every", "1", "--eval-every", "0", "--metrics-file", str(metrics)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=1800)
        if proc.returncode:
            raise SystemExit(f"{name}: train failed: {proc.stderr.strip().splitlines()[-1]}")
        predicted = float(re.search(r"predicted step ([\d.]+) ms", proc.stdout + proc.stderr)[1])
        ms = [r["ms_per_step"] for r in map(json.loads, metrics.read_text().splitlines())
              if "ms_per_step" in r][warmup:]
    q = statistics.quantiles(ms, n=5)
    measured = statistics.median(ms)
    return dict(config=name, predicted_ms=predicted, measured_ms=measured, p20_ms=q[0], p80_ms=q[-1],
                ratio=predicted / measured, steps=len(ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="text folder or file to train on")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    watch = LoadWatch()
    rows = [run(name, options, args.data, args.steps, args.warmup) for name, options in CONFIGS.items()]
    load = watch.stop()
    print(f"{'config':<24} {'predicted':>10} {'measured (20-80%)':>24} {'pred/meas':>9}")
    for r in rows:
        print(f"{r['config']:<24} {r['predicted_ms']:>8.1f} ms {r['measured_ms']:>8.1f} ms "
              f"({r['p20_ms']:.1f}-{r['p80_ms']:.1f}) {r['ratio']:>8.2f}x")
    print(f"load {load.label()}")
    write_json(args.json, "planner_step", rows, load.fields())


if __name__ == "__main__":
    main()
