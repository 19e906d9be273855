"""Whale's hardware-aware data parallelism on CPU: one gloo rank made slower, even vs aware split.

Three (``--ranks``) processes train the same tiny GPT through the window runtime (W=2) on the same
global batches. The last rank is made slower by ``--delay-ms`` per sample (a forward pre-hook that
sleeps: ``pystronghold.train.uneven.add_compute_delay``), a stand-in for an older GPU. Each
process runs two engines on two copies of the model, taking turns step by step (paired):

- even: every rank gets global_batch / ranks samples (the ordinary DP split);
- aware: Whale's split: each rank's samples proportional to its measured throughput (samples/s of
  its own forward passes in the even-split warm-up, gathered from every rank), ``balance_batch``, and each
  rank's mean loss scaled by b_r * n / B (``UnevenBatch``) so the gradient is the same.

Reported: the step time (per step, the slowest rank's; every rank waits for it at the all-reduce),
median and p20-p80, and the paired ratio even / aware (> 1: aware faster) over the rounds. Correctness
first: both runs' losses (the global-batch means) must agree to 1e-5 relative at every step, or the
script fails before printing a time. CPU figures on a small shared machine: the delay, not the
arithmetic, dominates a step by design, so the ratio shows the balancing, not a GPU's speed.

    .venv/bin/python bench/whale.py --json bench/results/whale.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # `common`, here and in the spawned ranks (they inherit sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common import LoadWatch, Timing, paired_ratio, print_table, write_json  # noqa: E402

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _rank_main(rank: int, args: dict, port: int, out: str) -> None:
    world = args["ranks"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import pystronghold as ph
    from pystronghold.models import GPT, GPTConfig
    from pystronghold.parallel import init_parallel
    from pystronghold.train.uneven import UnevenBatch, add_compute_delay

    groups = init_parallel(tp_size=1, backend="gloo", timeout_s=120)
    cfg = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=args["seq"], layers=args["layers"],
                    hidden=args["hidden"], heads=4)
    delay_s = args["delay_ms"] / 1e3 if rank == world - 1 else 0.0
    engines = {}
    for name in ("even", "aware"):
        model = GPT(cfg, seed=0)
        add_compute_delay(model, delay_s)
        engines[name] = ph.wrap(model, blocks=model.blocks, window=2, optimizer=ph.AdamW(**HYPER),
                                parallel=groups)
    B = args["global_batch"]
    if B % world:
        raise ValueError(f"--global-batch {B} must be divisible by --ranks {world} (the even split)")
    even = UnevenBatch(sizes=(B // world,) * world, dp_rank=rank)
    steps = args["warmup"] + args["steps"]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (steps, B, cfg.seq_len + 1), generator=g)

    def step(name: str, split: UnevenBatch, tokens: torch.Tensor) -> tuple[float, float, float]:
        """(slowest rank's seconds, global mean loss, this rank's forward seconds) of one step.
        The forward has no collective (TP = 1): its time is this rank's own speed, with no wait
        for a slower peer in it (the backward's per-block all-reduces would hide who is slow)."""
        engine = engines[name]
        mine = split.local(tokens)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(mine[:, :-1], mine[:, 1:])
        forward_s = time.perf_counter() - t0
        engine.backward(split.scale(loss))
        engine.step()
        engine.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        return float(elapsed), split.global_mean(loss, groups.dp_group), forward_s

    # warm-up on the even split: measure this rank's throughput, then Whale's split from all ranks'
    own_times, rec = [], {"even": [], "aware": [], "loss_even": [], "loss_aware": []}
    for k in range(args["warmup"]):
        _, loss, own = step("even", even, data[k])
        rec["loss_even"].append(loss)
        own_times.append(own)
    speed = torch.tensor([even.local_batch / sorted(own_times)[len(own_times) // 2]], dtype=torch.float64)
    speeds = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(speeds, speed)
    aware = UnevenBatch.from_speeds(B, [float(s) for s in speeds], dp_rank=rank)
    for k in range(args["warmup"]):  # the aware engine catches up on the same batches, untimed
        _, loss, _ = step("aware", aware, data[k])
        rec["loss_aware"].append(loss)
    for k in range(args["warmup"], steps):
        for name, split in (("even", even), ("aware", aware)):  # taking turns: paired per step
            t, loss, _ = step(name, split, data[k])
            rec[name].append(t)
            rec[f"loss_{name}"].append(loss)
    for engine in engines.values():
        engine.close()
    if rank == 0:
        rec.update(sizes=list(aware.sizes), speeds=[float(s) for s in speeds])
        Path(out).write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


def run(args: dict) -> dict:
    """Start the ranks, wait, and return rank 0's record (times, losses, the aware split)."""
    from pystronghold.parallel.groups import free_local_port

    port = free_local_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank_main, args=(args, port, out), nprocs=args["ranks"], start_method="spawn")
        return json.loads(Path(out).read_text())


def check_losses(rec: dict, rtol: float = 1e-5) -> None:
    """Raise when the even and aware runs' losses differ (they train on the same global batches)."""
    for k, (a, b) in enumerate(zip(rec["loss_even"], rec["loss_aware"], strict=True)):
        if abs(a - b) > rtol * abs(a):
            raise AssertionError(f"step {k}: even-split loss {a} but aware-split loss {b}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="sleep per sample on the last rank")
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each split (>= 10: pairs)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = vars(parser.parse_args())
    watch = LoadWatch()
    rec = run(args)
    load = watch.stop()
    check_losses(rec)
    even, aware = Timing.of(rec["even"]), Timing.of(rec["aware"])
    ratio = paired_ratio(even, aware)
    rows = [dict(split="even", samples=str([args["global_batch"] // args["ranks"]] * args["ranks"]),
                 median_ms=even.median_s * 1e3, p20_ms=even.p20_s * 1e3, p80_ms=even.p80_s * 1e3, ratio=""),
            dict(split="aware", samples=str(rec["sizes"]), median_ms=aware.median_s * 1e3,
                 p20_ms=aware.p20_s * 1e3, p80_ms=aware.p80_s * 1e3,
                 ratio=ratio.label())]
    print_table(rows, ["split", "samples", "median_ms", "p20_ms", "p80_ms", "ratio"],
                f"slowed rank: +{args['delay_ms']} ms/sample on rank {args['ranks'] - 1}; "
                f"measured speeds {[round(s, 1) for s in rec['speeds']]} samples/s; losses equal")
    print(f"load: {load}")
    write_json(args["json"], "whale", rows, extra=dict(args=args, ratio=asdict(ratio), sizes=rec["sizes"],
                                                       speeds=rec["speeds"], load=asdict(load)))


if __name__ == "__main__":
    main()
