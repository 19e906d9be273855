"""The engine's own per-block cost on the CPU backend: a deep, narrow GPT (32
blocks, hidden 32, seq 8 by default) where a block's compute is a few tens of microseconds, so what
the engine adds around each block (its Python: autograd Function, enter/leave, bookkeeping, copy
submissions) dominates.

Two configurations take turns step by step (bench/common.py's pairing):
  plain   plain PyTorch + torch.optim.AdamW, no recompute
  engine  pystronghold.wrap(window="all", checkpointing=False): every block streams through the
          window (loads, gradient copy-outs, host AdamW) with its activations kept, so it computes
          what plain computes and nothing more; tracing off
Reported: the step times, the paired time ratio engine / plain (median and p20-p80 of the per-step
ratios; NOTE: plain's torch AdamW runs on the calling thread, the engine's host AdamW on a worker
thread during backward, so on several cores this ratio can fall below 1 and is not the engine's
overhead alone); and, from a third, traced engine, the host time inside the engine's per-block
calls (trace kind "engine": enter/leave, waits included) in ms per block and pass (forward or
backward). Losses are checked equal to plain's first. Nothing here asserts a time.

    .venv/bin/python bench/engine_overhead.py --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIN_PAIRS, LoadWatch, add_gpt_arguments, paired_ratio, print_table, write_json  # noqa: E402
from window import Plain, Windowed  # noqa: E402

from pystronghold.models import GPT, GPTConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_arguments(parser, layers=32, hidden=32, seq=8, steps=60, warmup=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps {args.steps}: at least {MIN_PAIRS} timed steps are needed")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq, layers=args.layers, hidden=args.hidden,
                    heads=max(1, args.hidden // 32))
    base = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g),
                torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g))
               for _ in range(args.warmup + args.steps)]
    # every block streamed, activations kept: what plain computes, through the engine
    trainers = {"plain": Plain(copy.deepcopy(base)),
                "engine": Windowed(copy.deepcopy(base), "all", checkpointing=False, trace=False),
                "traced": Windowed(copy.deepcopy(base), "all", checkpointing=False)}
    losses = {name: [] for name in trainers}
    times = {name: [] for name in trainers}
    watch = LoadWatch()
    for k, (x, y) in enumerate(batches):
        if k == args.warmup:
            trainers["traced"].engine.synchronize()
            trainers["traced"].engine.trace.clear()
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            losses[name].append(trainer.step(x, y))
            times[name].append(time.perf_counter() - t0)
    load = watch.stop().fields()
    traced = trainers["traced"].engine
    traced.synchronize()
    summary = traced.trace.summary()
    for name in ("engine", "traced"):
        torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses["plain"]), rtol=1e-5, atol=0,
                                   msg=f"{name}: losses differ from plain PyTorch")
        trainers[name].engine.close()
    calls = 2 * args.layers  # one forward and one backward per block and step
    ratio = paired_ratio(times["engine"][args.warmup:], times["plain"][args.warmup:])
    row = {"plain_step_ms": 1e3 * statistics.median(times["plain"][args.warmup:]),
           "engine_step_ms": 1e3 * statistics.median(times["engine"][args.warmup:]),
           "engine_vs_plain": ratio.median, "engine_vs_plain (p20-p80)": ratio.label(),
           "engine_calls_ms_per_block": (1e3 * summary.time_s["engine"] / (args.steps * calls)
                                         if "engine" in summary.time_s else "-"),
           **load}
    title = (f"GPT {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, {args.steps} "
             f"timed steps after {args.warmup} warm-up (CPU backend); per block = per block and pass")
    print_table([row], [c for c in row if c not in ("load_start", "load_end", "loaded")], title)
    write_json(args.json, "engine_overhead", [row], {"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
