"""NVMe tier benchmark: the file tier's bandwidth during training against the raw disk, and the
step time with every block state on disk against the same training in host memory.

In one run:
  raw disk    sequential O_DIRECT write (then fsync) and read of --raw-mib MiB in 16 MiB requests,
              in the same directory: the disk's own figure, the baseline of the bandwidths
  ram         a GPT trained through pystronghold.wrap with every state in host memory
  disk        the same GPT, same weights and batches, with nvme_states="all" (master, moments and
              streamed gradients on disk, staged through the 4-block host cache)
The two trainings take turns step by step (fair under a shared machine's varying load); the step
time ratio is the median (p20-p80) of the per-step ratios disk / RAM (bench/common.paired_ratio, at
least 10 timed steps); the load at start and end is in every row. Step times are taken as the loop
sees them (the last steps' write-backs overlap the next step's compute); their
losses must be identical before any time is reported. File-tier bandwidth = bytes moved / the
time a read (or write) was in flight (union of the trace's intervals), over the timed steps.

    .venv/bin/python bench/nvme.py                       # 8 blocks, hidden 1024 (100M params)
    .venv/bin/python bench/nvme.py --quick --json bench/results/nvme.json
"""

from __future__ import annotations

import argparse
import copy
import logging
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIN_PAIRS, LoadWatch, add_gpt_arguments, paired_ratio, print_table,  # noqa: E402
                    token_batches, write_json)
from window import Windowed  # noqa: E402

from pystronghold.models import GPT, GPTConfig  # noqa: E402

_CHUNK = 16 << 20


def raw_disk(directory: Path, nbytes: int) -> dict:
    """Sequential O_DIRECT write (+ fsync) and read of ``nbytes`` in ``directory``: GB/s each."""
    path = directory / f"raw-{os.getpid()}.bin"
    buf = mmap.mmap(-1, _CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (_CHUNK // 4096))
    flags = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        t0 = time.perf_counter()
        for _ in range(nbytes // _CHUNK):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    moved = nbytes // _CHUNK * _CHUNK
    return {"write_gbps": moved / write_s / 1e9, "read_gbps": moved / read_s / 1e9, "direct": bool(flags)}


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals, seconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_arguments(parser, layers=8, hidden=1024, seq=64, steps=MIN_PAIRS, warmup=1)
    parser.add_argument("--raw-mib", type=int, default=1024, help="MiB written and read for the raw figure")
    parser.add_argument("--dir", default=None, help="directory for the tier and the raw test (default: temp)")
    parser.add_argument("--quick", action="store_true", help="6 blocks, hidden 512, 256 MiB raw")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.raw_mib = 6, 512, 256
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps {args.steps}: the paired ratio needs at least {MIN_PAIRS} timed steps")
    logging.basicConfig(level=logging.WARNING)
    root = Path(args.dir or tempfile.gettempdir()) / f"pystronghold-bench-nvme-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: Path) -> int:
    watch = LoadWatch()
    raw = raw_disk(root, args.raw_mib << 20)
    cfg = GPTConfig(vocab_size=8192, seq_len=args.seq, layers=args.layers, hidden=args.hidden,
                    heads=max(1, args.hidden // 64))
    base = GPT(cfg)
    params = sum(p.numel() for p in base.parameters())
    batches = token_batches(cfg.vocab_size, args.batch, args.seq, args.warmup + args.steps)
    trainers = {"ram": Windowed(copy.deepcopy(base), 2),
                "disk": Windowed(copy.deepcopy(base), 2, nvme_dir=str(root / "tier"), nvme_states="all")}
    del base
    losses = {name: [] for name in trainers}
    times = {name: [] for name in trainers}
    disk = trainers["disk"].engine
    for k, (x, y) in enumerate(batches):
        if k == args.warmup:
            for t in trainers.values():
                t.engine.trace.clear()
            before = dict(disk.stats()["disk"])
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            losses[name].append(trainer.step(x, y))
            times[name].append(time.perf_counter() - t0)
    for t in trainers.values():
        t.engine.synchronize()  # the last write-backs belong to the measured steps
    load = watch.stop().fields()
    after = disk.stats()["disk"]
    events = disk.trace.events()
    placement = disk.placement.describe(disk.n_blocks)
    for t in trainers.values():
        t.engine.close()
    if losses["disk"] != losses["ram"]:  # correctness before timing
        raise SystemExit(f"losses differ: disk {losses['disk']} vs ram {losses['ram']}")

    read_b = after["read_bytes"] - before["read_bytes"]
    write_b = after["write_bytes"] - before["write_bytes"]
    read_s = union_s([(e.start_s, e.end_s) for e in events if e.kind == "file_read"])
    write_s = union_s([(e.start_s, e.end_s) for e in events if e.kind == "file_write"])
    med = {name: sorted(ts[args.warmup:])[len(ts[args.warmup:]) // 2] for name, ts in times.items()}
    slowdown = paired_ratio(times["disk"][args.warmup:], times["ram"][args.warmup:])  # disk / RAM per step
    rows = [
        {"what": "raw disk write (O_DIRECT, fsync)", "GB/s": raw["write_gbps"], "ratio": 1.0, "baseline": "-"},
        {"what": "raw disk read (O_DIRECT)", "GB/s": raw["read_gbps"], "ratio": 1.0, "baseline": "-"},
        {"what": "tier write during training", "GB/s": write_b / max(write_s, 1e-9) / 1e9,
         "ratio": write_b / max(write_s, 1e-9) / 1e9 / raw["write_gbps"], "baseline": "raw write"},
        {"what": "tier read during training", "GB/s": read_b / max(read_s, 1e-9) / 1e9,
         "ratio": read_b / max(read_s, 1e-9) / 1e9 / raw["read_gbps"], "baseline": "raw read"},
        {"what": "step time, states in RAM", "GB/s": "-", "ratio": 1.0, "baseline": f"{1e3 * med['ram']:.0f} ms"},
        {"what": "step time, states on disk", "GB/s": "-", "ratio": slowdown.median,
         "baseline": f"states in RAM (paired: {slowdown.label()})"},
    ]
    rows = [dict(r, load=load["load"]) for r in rows]
    spreads = {"step time, states on disk": (slowdown.p20, slowdown.p80)}  # the only paired ratio here
    records = [dict(r, kind=kind, ratio_p20=spreads.get(r["what"], (r["ratio"],) * 2)[0],
                    ratio_p80=spreads.get(r["what"], (r["ratio"],) * 2)[1], **load)
               for r, kind in zip(rows, ("raw", "raw", "tier", "tier", "step", "step"))]
    extra = {"args": vars(args), "placement": placement, "read_bytes_per_step": read_b / args.steps,
             "write_bytes_per_step": write_b / args.steps, "step_ms": {k: 1e3 * v for k, v in med.items()},
             "disk_io_share_of_step": (read_s + write_s) / args.steps / med["disk"], "params": params,
             "raw_direct_io": raw["direct"]}
    title = (f"GPT {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, W=2; "
             f"{args.steps} timed steps after {args.warmup} warm-up; disk run: {placement}; per step "
             f"{read_b / args.steps / 2**30:.2f} GiB read, {write_b / args.steps / 2**30:.2f} GiB written")
    print_table(rows, list(rows[0]), title)
    write_json(args.json, "nvme", records, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
