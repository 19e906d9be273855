"""Time to first step: building and filling the host store of a lazily built GPT at wrap().

``wrap()`` of a ``GPT(..., materialize_blocks=False)`` makes the store's arenas (pinned on CUDA)
in a builder thread and materializes the blocks in ``init_threads`` worker threads ahead of the
copy into the store. This script wraps the same model with several thread counts (the baseline is
1 thread, measured in the same run, configurations taking turns per repetition), checks that every
store holds the same values (a float64 fingerprint of every block's master), and reports the
phases that ``fill_store`` logs: total, init (summed over threads), arenas, copy, and the time the
fill waited for init and for arenas.

    .venv/bin/python bench/store_fill.py                      # 4 blocks of gpt3-1.3b's shape
    .venv/bin/python bench/store_fill.py --layers 8 --threads 1 2 4 8 --json bench/results/fill.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

import pystronghold as ph  # noqa: E402
from pystronghold.models import GPT, GPTConfig  # noqa: E402
from pystronghold.models.presets import block_param_count  # noqa: E402


def fingerprint(engine) -> list[tuple[float, float]]:
    """(sum, sum of every 4099th element) of each block's fp32 master, in float64."""
    out = []
    for b in range(engine.n_blocks):
        m = torch.cat([v.reshape(-1) for v in engine.states.read_block(b, ("master",))["master"].values()])
        out.append((float(m.sum(dtype=torch.float64)), float(m[::4099].sum(dtype=torch.float64))))
    return out


def one_run(cfg: GPTConfig, threads: int, device: str, precision: str):
    model = GPT(cfg, seed=0, materialize_blocks=False)
    engine = ph.wrap(model, window=2, device=device, precision=precision, init_threads=threads)
    try:
        return dict(engine.fill_times), fingerprint(engine)
    finally:
        engine.close()
        del engine, model
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048, help="model width (gpt3-1.3b: 2048)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # a byte vocabulary: the head and tail stay small, the blocks are what is measured
    cfg = GPTConfig(vocab_size=256, seq_len=2048, layers=args.layers, hidden=args.hidden, heads=args.heads)
    print(f"{args.layers} blocks of {block_param_count(cfg) / 1e6:.1f}M parameters "
          f"(store: {args.layers * block_param_count(cfg) * 16 / 2**30:.1f} GiB in fp32), {args.device}, "
          f"{args.precision}, torch intra-op threads {torch.get_num_threads()}")
    samples = {t: [] for t in args.threads}
    reference = None
    for _ in range(args.reps):
        for t in args.threads:  # configurations take turns: fair under a shared machine's load
            times, fp = one_run(cfg, t, args.device, args.precision)
            if reference is None:
                reference = fp
            if fp != reference:
                raise SystemExit(f"init_threads={t}: the store differs from the first run's: "
                                 f"{fp} != {reference}")
            samples[t].append(times)
    base = statistics.median(s["total"] for s in samples[args.threads[0]])
    rows = []
    for t, runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("total", "init", "init_wait", "arenas",
                                                                   "arena_wait", "copy")}
        rows.append(dict(init_threads=t, **{f"{k} s": v for k, v in med.items()},
                         speedup=base / med["total"], reps=len(runs)))
    print_table(rows, list(rows[0]), "wrap(): store ready (median seconds; init and arenas are work, "
                "the waits are what the fill spent on them)")
    write_json(args.json, "store_fill", rows, extra=dict(layers=args.layers, hidden=args.hidden,
                                                         device=args.device, precision=args.precision))


if __name__ == "__main__":
    main()
