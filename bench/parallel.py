"""Parallelism benchmark: a tiny GPT through the window runtime at TP 1/2 x DP 1/2 and with two
pipeline stages (PP 2 1F1B, PP 2 x TP 2, and PP 2 interleaved with v = 2 model chunks per rank),
gloo on CPU.

Every configuration trains the same model (same initial weights, same global batches: strong
scaling, each DP rank gets global_batch / dp sequences) with W=2 blocks resident, one process per
rank, gloo on the loopback. Reported per configuration:

- step time: per step, the slowest rank's time (every rank waits for it at the next collective);
  median and 20/80% quantiles over the timed steps, and the ratio to TP=1 x DP=1 (the baseline,
  measured in the same run), paired: every configuration's processes start once and stay up, and
  the configurations take turns in rounds of a few steps (1x1, 2x1, 1x2, 2x2, 1x1, ...; the idle
  ones wait on a file); the ratio is the median (p20-p80) over the rounds of the per-round ratios
  (bench/common.paired_ratio, at least 10 rounds);
- communication per rank per step, in bytes handed to the collectives, *computed* from the
  parameter counts and activation shapes (formulas below) and *measured* by a wrapper around
  ``torch.distributed.all_reduce`` / ``all_gather`` that adds up the bytes of the tensors this
  rank passes in (for all_gather: its own input), split by group (TP, DP, world).

Computed, per rank per step (fp32, b = global_batch / dp sequences of T tokens, hidden C, L blocks,
padded vocabulary V, checkpointing on so each block's forward runs twice):
  TP: 4 * b*T*C * (6 L + 2)  [per block 2 all_reduces forward, 2 again in the recompute, 2 in the
      backward of the column-parallel inputs; head 1 (embedding), tail 1 (LM head input grad)]
      + 16 * b*T  [the vocab-parallel cross-entropy's two all_reduces of per-row fp32 stats: the max,
      then sum-exp, target logit and logit sum] + 8 (clipping norm, float64)
  DP: 4 * (this rank's parameters)  [every gradient averaged once]
  PP (rank 0 = stage 0, L/2 blocks, head, no tail; m = 2 micro-batches): p2p 4 * b*T*C [its m
      activations of b/m sequences sent forward; the gradients come back (received, not counted)],
      pp 8 (the clipping norm summed over the stages, float64); its TP figure is that of its own
      blocks and head: 4 * b*T*C * (6 L/2 + 1) + 8.
      p2p bytes are measured by a wrapper around the schedules' ``_batch_p2p`` (sends only).
  PP interleaved (v chunks per rank; rank 0 holds chunks 0, p, ...): p2p (2v - 1) * 4 * b*T*C
      [each of its v chunks sends its activations forward, and each but chunk 0 (virtual stage 0)
      sends its input gradients back]; pp 8.
The measured DP figure is larger when a block's flat buffer carries alignment padding (store.py:
parameters start at multiples of 16 elements; the default shapes here need none).

These are CPU figures on a small, shared machine: processes compete for cores (ranks beyond the
core count are oversubscribed), and gloo on loopback is not a GPU interconnect. They show the
runtime's behaviour and communication volume, not the speed-up a GPU cluster would see.
Correctness first: each configuration's losses must equal TP=1 x DP=1's before times are shown.

    .venv/bin/python bench/parallel.py --json bench/results/parallel.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # `common`, here and in the spawned ranks (they inherit sys.path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from common import MIN_PAIRS, LoadWatch, Timing, paired_ratio, print_table, write_json  # noqa: E402

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1),
           (1, 1, 2, 2)]  # (tp, dp, pp, v model chunks per pipeline rank: v > 1 is the interleaved schedule)
MICRO_BATCHES = 2  # per step through a pipeline


# ---- counting the bytes handed to collectives


class Counter:
    """Wraps torch.distributed.all_reduce / all_gather; adds up input bytes per group kind."""

    def __init__(self, groups) -> None:
        self.groups, self.on = groups, False
        self.bytes = {"tp": 0, "dp": 0, "pp": 0, "world": 0, "p2p": 0}
        self._all_reduce, self._all_gather = dist.all_reduce, dist.all_gather
        dist.all_reduce, dist.all_gather = self.all_reduce, self.all_gather
        # NOTE: torch's schedules send through this (private) helper, batched or not
        from torch.distributed.pipelining import schedules
        self._schedules, self._batch_p2p = schedules, schedules._batch_p2p
        schedules._batch_p2p = self.batch_p2p

    def batch_p2p(self, ops, desc=None):
        if self.on:
            self.bytes["p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                     if op.op is dist.isend)
        return self._batch_p2p(ops, desc=desc)

    def _kind(self, group) -> str:
        # NOTE: with tp=1 the TP group holds one rank and no collective reaches it; with dp=1 the
        # same holds for the DP group. World is the default group (None).
        if group is None:
            return "world"
        if group is self.groups.tp_group:
            return "tp"
        return "dp" if group is self.groups.dp_group else "pp"

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if self.on:
            self.bytes[self._kind(group)] += tensor.numel() * tensor.element_size()
        return self._all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        if self.on:
            self.bytes[self._kind(group)] += tensor.numel() * tensor.element_size()
        return self._all_gather(tensor_list, tensor, group=group, async_op=async_op)


# ---- one rank


def _wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.005)


def _rank_main(rank: int, args: dict, tp: int, dp: int, pp: int, chunks: int, port: int, ctl: str) -> None:
    world = tp * dp * pp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(level=logging.WARNING)
    import pystronghold as ph
    from pystronghold.models import GPT, GPTConfig
    from pystronghold.parallel import init_parallel

    groups = init_parallel(tp_size=tp, dp_size=dp, pp=pp, backend="gloo", timeout_s=120)
    cfg = GPTConfig(vocab_size=args["vocab"], seq_len=args["seq"], layers=args["layers"],
                    hidden=args["hidden"], heads=args["heads"], vocab_pad_multiple=2, tp_size=tp)
    model = GPT(cfg, seed=0, tp_group=groups.tp_group)
    options = dict(window=2, optimizer=ph.AdamW(**HYPER), clip_grad_norm=1.0)
    pipe = None
    if pp > 1:
        from pystronghold.pipelining import gpt_pipeline

        per_block = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
        ends = sum(p.numel() for p in (model.head if groups.pp_rank == 0 else model.tail).parameters())
        pipe = gpt_pipeline(model, groups, micro_batches=MICRO_BATCHES, chunks=chunks,
                            schedule="interleaved" if chunks > 1 else "1f1b", **options)
        engine = pipe.engine  # (its blocks' parameters are placeholders now: counted before)
        n_local = ends + sum(per_block[i] for i in pipe.stage_blocks[groups.pp_rank])
    else:
        n_local = sum(p.numel() for p in model.parameters())
        engine = ph.wrap(model, blocks=model.blocks, parallel=groups, **options)
    counter = Counter(groups)
    g = torch.Generator().manual_seed(0)
    steps = args["warmup"] + args["steps"]
    data = torch.randint(0, cfg.vocab_size, (steps, args["batch"], args["seq"] + 1), generator=g)
    b = args["batch"] // dp
    mine = data[:, groups.dp_rank * b:(groups.dp_rank + 1) * b]  # (steps, b, T + 1)
    times, losses, measured = [], [], []
    ctl, name, per_round = Path(ctl), _name((tp, dp, pp, chunks)), args["steps"] // args["rounds"]
    try:
        for k, tokens in enumerate(mine):
            timed = k - args["warmup"]
            if timed >= 0 and timed % per_round == 0:  # this configuration's turn
                _wait_for(ctl / f"go-{name}-{timed // per_round}")
            dist.barrier()
            before = dict(counter.bytes)
            counter.on = True
            t0 = time.perf_counter()
            if pipe is not None:
                loss = torch.tensor(pipe.step(tokens[:, :-1], tokens[:, 1:]))
            else:
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                engine.zero_grad()
            times.append(time.perf_counter() - t0)
            counter.on = False
            measured.append({key: counter.bytes[key] - before[key] for key in before})
            mean = loss.detach().reshape(1).clone()
            dist.all_reduce(mean, group=groups.dp_group)
            losses.append(mean.item() / dp)
            if timed >= 0 and timed % per_round == per_round - 1:  # the turn ends
                dist.barrier()
                if rank == 0:
                    (ctl / f"done-{name}-{timed // per_round}").touch()
    finally:
        engine.close()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    if rank == 0:
        (ctl / f"rank0-{name}.json").write_text(json.dumps(dict(
            times=slowest[args["warmup"]:].tolist(), losses=losses, measured=measured[-1],
            n_local=n_local, padded_vocab=cfg.padded_vocab_size, threads=torch.get_num_threads())))
    dist.barrier()
    dist.destroy_process_group()


def _name(config: tuple[int, int, int, int]) -> str:
    tp, dp, pp, chunks = config
    return f"{tp}x{dp}x{pp}" + (f"v{chunks}" if chunks > 1 else "")


def run_configs(args: dict) -> dict:
    """Start every (tp, dp, pp, v) configuration's processes once, let them take turns for
    ``rounds`` rounds of steps // rounds steps, and return each configuration's rank-0 record."""
    from pystronghold.parallel.groups import free_local_port

    ports = set()
    while len(ports) < len(CONFIGS):
        ports.add(free_local_port())
    with tempfile.TemporaryDirectory() as tmp:
        ctl = Path(tmp)
        contexts = {cfg: mp.start_processes(_rank_main, args=(args, *cfg, port, tmp), nprocs=cfg[0] * cfg[1] * cfg[2],
                                            start_method="spawn", join=False)
                    for cfg, port in zip(CONFIGS, sorted(ports))}
        for r in range(args["rounds"]):
            for cfg in CONFIGS:
                (ctl / f"go-{_name(cfg)}-{r}").touch()
                while not (ctl / f"done-{_name(cfg)}-{r}").exists():
                    for ctx in contexts.values():
                        ctx.join(timeout=0.002)  # raises when a rank failed
        for ctx in contexts.values():
            while not ctx.join():
                pass
        return {cfg: json.loads((ctl / f"rank0-{_name(cfg)}.json").read_text()) for cfg in CONFIGS}


def round_medians(times: list[float], rounds: int) -> list[float]:
    """The median step time of each round (consecutive equal slices of ``times``)."""
    per = len(times) // rounds
    return [Timing.of(times[r * per:(r + 1) * per]).median_s for r in range(rounds)]


def computed_bytes(args: dict, tp: int, dp: int, pp: int, chunks: int, rec: dict) -> dict:
    """Bytes per rank (rank 0) per step from the formulas in the module docstring."""
    b, T, C, L = args["batch"] // dp, args["seq"], args["hidden"], args["layers"]
    if pp == 1:
        tp_bytes = 4 * b * T * C * (6 * L + 2) + 16 * b * T + 8 if tp > 1 else 0
        return {"tp": tp_bytes, "dp": 4 * rec["n_local"] if dp > 1 else 0, "pp": 0, "p2p": 0}
    tp_bytes = 4 * b * T * C * (6 * L // pp + 1) + 8 if tp > 1 else 0  # stage 0: L/pp blocks and the head
    return {"tp": tp_bytes, "dp": 4 * rec["n_local"] if dp > 1 else 0, "pp": 8, "p2p": (2 * chunks - 1) * 4 * b * T * C}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over DP")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=MIN_PAIRS,
                        help="turns each configuration takes (pairs); --steps is split evenly over them")
    parser.add_argument("--quick", action="store_true", help="10 rounds of 1 step after 1 warm-up")
    parser.add_argument("--json", default=None, help="write the records here")
    args = vars(parser.parse_args(argv))
    if args.pop("quick"):
        args.update(steps=MIN_PAIRS, warmup=1, rounds=MIN_PAIRS)
    if args["rounds"] < MIN_PAIRS or args["steps"] < args["rounds"]:
        parser.error(f"--rounds {args['rounds']} must be >= {MIN_PAIRS} and <= --steps {args['steps']}")
    args["steps"] -= args["steps"] % args["rounds"]
    watch = LoadWatch()
    results = run_configs(args)
    load = watch.stop().fields()
    base = results[(1, 1, 1, 1)]
    for (tp, dp, pp, chunks), rec in results.items():  # correctness before timing
        # NOTE: summation order differs across layouts; over the steps losses agree to ~1e-6
        torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(base["losses"]), rtol=1e-4, atol=0,
                                   msg=f"tp={tp} dp={dp} pp={pp} v={chunks}: losses differ from 1x1x1")
    base_rounds = round_medians(base["times"], args["rounds"])
    rows = []
    for (tp, dp, pp, chunks), rec in results.items():
        t, comp, meas = Timing.of(rec["times"]), computed_bytes(args, tp, dp, pp, chunks, rec), rec["measured"]
        vs = paired_ratio(round_medians(rec["times"], args["rounds"]), base_rounds)  # time ratio, per round
        rows.append({"tp": tp, "dp": dp, "pp": pp, "v": chunks, "procs": tp * dp * pp, "threads/proc": rec["threads"],
                     "step_ms": 1e3 * t.median_s, "p20_ms": 1e3 * t.p20_s, "p80_ms": 1e3 * t.p80_s,
                     "vs_1x1": vs.median, "vs_1x1_p20": vs.p20, "vs_1x1_p80": vs.p80, "params/rank": rec["n_local"],
                     "tp_bytes_computed": comp["tp"], "tp_bytes_measured": meas["tp"],
                     "dp_bytes_computed": comp["dp"], "dp_bytes_measured": meas["dp"],
                     "pp_bytes_computed": comp["pp"], "pp_bytes_measured": meas["pp"],
                     "p2p_bytes_computed": comp["p2p"], "p2p_bytes_measured": meas["p2p"],
                     "world_bytes_measured": meas["world"], **load})
    title = (f"GPT {args['layers']} blocks, hidden {args['hidden']}, heads {args['heads']}, seq "
             f"{args['seq']}, vocab {args['vocab']}, global batch {args['batch']}, W=2, fp32, clip 1.0; "
             f"{args['steps']} timed steps after {args['warmup']} warm-up, in {args['rounds']} turns; gloo on CPU "
             f"({os.cpu_count()} cores); bytes per rank per step")
    print_table(rows, [c for c in rows[0] if c not in ("load_start", "load_end", "loaded")], title)
    write_json(args["json"], "parallel", rows, {"args": args})
    return 0


if __name__ == "__main__":
    sys.exit(main())
