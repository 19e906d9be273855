"""Window runtime benchmark: one GPT trained resident versus windowed, in the same run.

Configurations (all from the same initial weights, on the same batches):
  plain      plain PyTorch + torch.optim.AdamW, everything resident, no checkpointing (baseline)
  W=all      the engine with every block in the window (same recompute as the windowed runs)
  K=N        every block device-resident with a device AdamW, no recompute (resident_blocks=N):
             plain PyTorch's arithmetic through the engine; its overhead over plain is the engine's own
  W=4, W=2   the engine with 4 / 2 blocks resident
Configurations take turns step by step (fair under a shared machine's varying load).
Reported: median step time and 20/80% quantiles; the time ratios to W=all and to plain, each the
median (p20-p80) of the per-step ratios (step k of a configuration over step k of the baseline, taken
back to back: bench/common.paired_ratio); the load at start and end; device bytes
(parameters, gradients and optimizer states that live on the device: the window arena plus head
and tail) against plain's, the bound (W + head + tail) / (all blocks + head + tail) in parameters,
and the overlap fraction from the trace. Correctness first: every configuration's losses must
equal plain PyTorch's before any time is reported.

    .venv/bin/python bench/window.py                 # 12 blocks, hidden 512, seq 256
    .venv/bin/python bench/window.py --quick --json bench/results/window.json

With ``--accumulation 1,4,16`` it compares instead the two accumulation schedules (runtime/streaming/relay.py)
for each m: ``default`` (micro-batch-major, the baseline) and ``--schedule relay`` (layer-major),
the same W, taking turns step by step; per step: time, H2D bytes, D2H bytes and, with ``--nvme DIR``
(every state on disk), the file tier's read and written bytes. Correctness first: both schedules'
losses must agree (1e-6 relative) before anything is reported.

    .venv/bin/python bench/window.py --quick --accumulation 1,4,16 --schedule relay --window 2
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIN_PAIRS, LoadWatch, Timing, TorchTrainer, WrappedTrainer, add_gpt_arguments,  # noqa: E402
                    paired_ratio, print_table, token_batches, write_json)

import pystronghold as ph  # noqa: E402
from pystronghold.models import GPT, GPTConfig  # noqa: E402

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class Plain(TorchTrainer):
    """Plain PyTorch + torch.optim.AdamW, everything resident (``clip``: torch.nn.utils.clip_grad_norm_
    to this norm before each step; None: no clipping)."""

    def __init__(self, model, clip: float | None = None) -> None:
        super().__init__(model, torch.optim.AdamW(model.parameters(), **HYPER), clip=clip)

    def extra(self, timed_steps: int) -> dict:
        n = sum(p.numel() for p in self.model.parameters())
        return {"device_bytes": 16 * n}  # fp32 param, grad, exp_avg, exp_avg_sq


class Windowed(WrappedTrainer):
    """The same training through pystronghold.wrap with ``window`` blocks resident (``options``:
    more wrap options, e.g. the NVMe tier's in bench/nvme.py; tracing is on unless ``trace=False``)."""

    def __init__(self, model, window, **options) -> None:
        super().__init__(ph.wrap(model, blocks=model.blocks, window=window, optimizer=ph.AdamW(**HYPER),
                                 **{"trace": True, **options}))

    def extra(self, timed_steps: int) -> dict:
        engine = self.engine
        engine.synchronize()
        ht = sum(p.numel() for p in engine.head_tail_params)
        stats, summary = engine.stats(), engine.trace.summary()
        return {"device_bytes": stats["arena_used_bytes"] + 16 * ht + stats["resident_bytes"],
                "overlap": summary.overlap_fraction,
                "stall_ms": 1e3 * summary.stall_s / timed_steps}


# ---- accumulation schedules (--accumulation)


class Accumulating(Windowed):
    """One step = ``m`` micro-batches through ``engine.accumulate`` under ``schedule``."""

    def __init__(self, model, window, m: int, schedule: str, **options) -> None:
        super().__init__(model, window, accumulation_steps=m, schedule=schedule, **options)
        self.m = m

    def step(self, batches) -> list[float]:
        losses = self.engine.accumulate(batches, lambda b: self.engine(*b))
        self.engine.step()
        self.engine.zero_grad()
        return losses.tolist()

    def moved(self) -> dict:
        """Bytes moved since the trace was cleared (link) and since wrap (disk)."""
        self.engine.synchronize()
        link = self.engine.trace.summary().bytes
        disk = self.engine.stats()["disk"] or {}
        return {"h2d": link.get("h2d", 0), "d2h": link.get("d2h", 0),
                "disk_read": disk.get("read_bytes", 0), "disk_write": disk.get("write_bytes", 0)}


def schedules_main(args, base, cfg) -> int:
    """Relay versus default accumulation for each m of ``args.accumulation``."""
    options = {} if args.nvme is None else {"nvme_dir": args.nvme, "nvme_states": "all"}
    window = args.window if args.window == "all" else int(args.window)
    schedules = ["default"] + ([] if args.schedule == "default" else [args.schedule])
    rows = []
    watch = LoadWatch()
    for m in args.accumulation:
        flat = token_batches(cfg.vocab_size, args.batch, args.seq, m * (args.warmup + args.steps), seed=m)
        batches = [flat[i:i + m] for i in range(0, len(flat), m)]  # m micro-batches per step
        trainers = {s: Accumulating(copy.deepcopy(base), window, m, s, **options) for s in schedules}
        losses = {s: [] for s in schedules}
        times = {s: [] for s in schedules}
        start = {}
        for k, step_batches in enumerate(batches):
            for s, trainer in trainers.items():  # NOTE: turns step by step, as main() does
                if k == args.warmup:
                    trainer.engine.synchronize()
                    trainer.engine.trace.clear()
                    start[s] = trainer.moved()
                t0 = time.perf_counter()
                losses[s] += trainer.step(step_batches)
                times[s].append(time.perf_counter() - t0)
        moved = {}
        for s, trainer in trainers.items():
            end = trainer.moved()
            moved[s] = {key: (end[key] - (start[s][key] if key.startswith("disk") else 0)) / args.steps
                        for key in end}
            trainer.close()
        for s in schedules:  # correctness before timing
            torch.testing.assert_close(torch.tensor(losses[s]), torch.tensor(losses["default"]), rtol=1e-6,
                                       atol=0, msg=f"m={m} {s}: losses differ from the default schedule")
        for s in schedules:
            t = Timing.of(times[s][args.warmup:])
            ratio = paired_ratio(times["default"][args.warmup:], times[s][args.warmup:])
            rows.append({"m": m, "schedule": s, "step_ms": 1e3 * t.median_s, "p20_ms": 1e3 * t.p20_s,
                         "p80_ms": 1e3 * t.p80_s, "speedup_vs_default": ratio.median,
                         "speedup (p20-p80)": ratio.label(),
                         "h2d_MB/step": moved[s]["h2d"] / 1e6, "d2h_MB/step": moved[s]["d2h"] / 1e6,
                         "disk_read_MB/step": moved[s]["disk_read"] / 1e6,
                         "disk_write_MB/step": moved[s]["disk_write"] / 1e6})
    load = watch.stop().fields()
    for row in rows:
        row.update(load)
    title = (f"GPT {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, micro-batch {args.batch}, "
             f"W={args.window}, fp32, {args.steps} timed steps after {args.warmup} warm-up (CPU backend"
             f"{', every state on NVMe' if args.nvme else ''})")
    print_table(rows, [c for c in rows[0] if c not in ("load_start", "load_end", "loaded")], title)
    write_json(args.json, "window_schedules", rows, {"args": vars(args)})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_arguments(parser, layers=12, hidden=512, seq=256, steps=MIN_PAIRS, warmup=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="6 blocks, hidden 256, seq 128")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument("--accumulation", default=None,
                        help="comma-separated micro-batch counts m: compare the accumulation schedules")
    parser.add_argument("--schedule", default="relay", choices=("relay", "default"),
                        help="with --accumulation: the schedule measured against the default one")
    parser.add_argument("--window", default="2", help="with --accumulation: W (a number or all)")
    parser.add_argument("--nvme", default=None, help="with --accumulation: every state in the file tier here")
    parser.add_argument("--only", default=None,
                        help="comma-separated configurations to run (e.g. plain,K=N; plain and W=all, the "
                             "baselines of the ratios, are always run); default: all")
    args = parser.parse_args(argv)
    if args.accumulation is not None:
        try:
            args.accumulation = [int(m) for m in args.accumulation.split(",")]
        except ValueError:
            parser.error(f"--accumulation must be comma-separated integers, got {args.accumulation!r}")
        if min(args.accumulation) < 1:
            parser.error(f"--accumulation: every m must be >= 1, got {args.accumulation}")
    if args.quick:
        args.layers, args.hidden, args.seq = 6, 256, 128
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps {args.steps}: the paired ratios need at least {MIN_PAIRS} timed steps")
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=8192, seq_len=args.seq, layers=args.layers, hidden=args.hidden,
                    heads=max(1, args.hidden // 64))
    base = GPT(cfg)
    if args.accumulation is not None:
        return schedules_main(args, base, cfg)
    batches = token_batches(cfg.vocab_size, args.batch, args.seq, args.warmup + args.steps)
    n_block = sum(p.numel() for p in base.blocks[0].parameters())
    n_ht = sum(p.numel() for p in base.parameters()) - args.layers * n_block

    makers = {"plain": lambda: Plain(copy.deepcopy(base)),
              **{f"W={w}": (lambda w=w: Windowed(copy.deepcopy(base), w)) for w in ("all", 4, 2)},
              "K=N": lambda: Windowed(copy.deepcopy(base), "all", resident_blocks=args.layers)}
    only = set(makers) if args.only is None else {"plain", "W=all", *args.only.split(",")}
    if only - set(makers):
        parser.error(f"--only: unknown configurations {sorted(only - set(makers))}; known: {list(makers)}")
    trainers = {name: make() for name, make in makers.items() if name in only}
    losses = {name: [] for name in trainers}
    times = {name: [] for name in trainers}
    # NOTE: configurations take turns step by step, so load from other users of a shared machine
    # falls on all of them alike.
    watch = LoadWatch()
    for k, (x, y) in enumerate(batches):
        for name, trainer in trainers.items():
            if k == args.warmup and isinstance(trainer, Windowed):
                trainer.engine.synchronize()
                trainer.engine.trace.clear()
            t0 = time.perf_counter()
            losses[name].append(trainer.step(x, y))
            times[name].append(time.perf_counter() - t0)
    load = watch.stop().fields()
    runs = {}
    for name, trainer in trainers.items():
        runs[name] = (losses[name], times[name][args.warmup:], trainer.extra(args.steps))
        trainer.close()
    ref_losses = runs["plain"][0]
    for name, (run_losses, _, _) in runs.items():  # correctness before timing
        torch.testing.assert_close(torch.tensor(run_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=f"{name}: losses differ from plain PyTorch")

    plain_bytes = runs["plain"][2]["device_bytes"]
    rows = []
    for name, (_, times, extra) in runs.items():
        t = Timing.of(times)
        w = {"plain": args.layers, "W=all": args.layers, "K=N": args.layers}.get(name) or int(name[2:])
        vs_all, vs_plain = paired_ratio(times, runs["W=all"][1]), paired_ratio(times, runs["plain"][1])
        rows.append({"config": name, "step_ms": 1e3 * t.median_s, "p20_ms": 1e3 * t.p20_s,
                     "p80_ms": 1e3 * t.p80_s, "vs_W=all": vs_all.median, "vs_W=all (p20-p80)": vs_all.label(),
                     "vs_plain": vs_plain.median, "vs_plain (p20-p80)": vs_plain.label(),
                     "device_MiB": extra["device_bytes"] / 2**20,
                     "bytes_vs_plain": extra["device_bytes"] / plain_bytes,
                     "bound": (w * n_block + n_ht) / (args.layers * n_block + n_ht),
                     "overlap": extra.get("overlap") if extra.get("overlap") is not None else "-",
                     "stall_ms": extra.get("stall_ms", "-"), "vs_plain_p20": vs_plain.p20,
                     "vs_plain_p80": vs_plain.p80, **load})
    title = (f"GPT {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, "
             f"{args.steps} timed steps after {args.warmup} warm-up (CPU backend)")
    hidden = ("load_start", "load_end", "loaded", "vs_plain_p20", "vs_plain_p80")  # in the JSON, not the table
    print_table(rows, [c for c in rows[0] if c not in hidden], title)
    write_json(args.json, "window", rows, {"args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
