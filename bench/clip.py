"""Clipping benchmark: the cost of global-norm gradient clipping, one GPT trained with and without it.

Configurations (all from the same initial weights, on the same batches, taking turns step by step):
  no clip          the engine, overlap "auto" (backward: block i updated as soon as its gradient is out)
  clip             the same with clip_grad_norm=1.0 (overlap "auto" becomes forward: the updates wait
                   for the global norm, then run block 0, 1, ... ahead of the next forward)
  no clip, fwd     no clipping with overlap="forward": the same schedule as "clip" without the norms,
                   so clip / this isolates the norm pass itself
and, apart, the host norm pass of one block (the CPU backend's, optim.functional.param_grad_norms):
the native multi-threaded ``param_grad_norms`` against the loop of ``torch.linalg.vector_norm`` it replaced,
taking turns (bench/common.interleave), results checked bit for bit first.
Correctness first: "clip" must give the losses of plain PyTorch with torch.nn.utils.clip_grad_norm_,
and the unclipped runs those of plain PyTorch without it (fp32, rtol 1e-5), before any time is
reported. Reported: median step time and the paired ratios clip / no clip and clip / no clip fwd
(median and p20-p80 of the per-step ratios, bench/common.paired_ratio), and the machine's load.

    .venv/bin/python bench/clip.py                  # the `small` preset: 12 blocks, hidden 512, seq 256
    .venv/bin/python bench/clip.py --window 2 --json bench/results/clip.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIN_PAIRS, LoadWatch, Timing, add_gpt_arguments, interleave, paired_ratio,  # noqa: E402
                    print_table, token_batches, write_json)
from window import HYPER, Plain, Windowed  # noqa: E402

from pystronghold.models import GPT  # noqa: E402
from pystronghold.models.presets import PRESETS  # noqa: E402

CLIP = 1.0


def _norm_pass_row(model) -> dict | None:
    """One block's host norm pass: native threads vs the one-thread torch loop, paired (None in a
    checkout without the native pass)."""
    try:
        from pystronghold.optim.functional import param_grad_norms
    except ImportError:  # a checkout before the native norm pass (a "before" run)
        return None
    grads = [torch.randn(p.shape) for p in model.blocks[0].parameters()]
    scale = 0.5  # the clip coefficient / loss scale path (a scaled fp32 copy per parameter)

    def torch_loop():
        return torch.stack([torch.linalg.vector_norm(g.float() * scale) for g in grads])

    assert torch.equal(param_grad_norms(grads, scale), torch_loop()), "native norms differ from torch's"
    watch = LoadWatch()
    t = interleave({"torch loop": torch_loop, "native": lambda: param_grad_norms(grads, scale)},
                   rounds=40, warmup=3)
    r = paired_ratio(t["torch loop"], t["native"])
    return {"pass": f"block 0's norms, {len(grads)} parameters, {torch.get_num_threads()} threads",
            "native_ms": 1e3 * t["native"].median_s, "torch_loop_ms": 1e3 * t["torch loop"].median_s,
            "x_torch_loop": 1 / r.median, "x_torch_loop (p20-p80)": f"{1 / r.median:.2f} ({1 / r.p80:.2f}-{1 / r.p20:.2f})",
            **watch.stop().fields()}


def main(argv=None) -> int:
    small = PRESETS["small"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_arguments(parser, layers=small.layers, hidden=small.hidden, seq=small.seq_len, steps=16, warmup=2)
    parser.add_argument("--window", default="all", help="W of the engine runs (an int or 'all')")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    window = args.window if args.window == "all" else int(args.window)
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps {args.steps}: the paired ratios need at least {MIN_PAIRS} timed steps")
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(small, layers=args.layers, hidden=args.hidden, seq_len=args.seq,
                       heads=max(1, args.hidden // 64))
    base = GPT(cfg)
    batches = token_batches(cfg.vocab_size, args.batch, args.seq, args.warmup + args.steps)

    references = {"plain": Plain(copy.deepcopy(base)), "plain clip": Plain(copy.deepcopy(base), clip=CLIP)}
    trainers = {"no clip": Windowed(copy.deepcopy(base), window),
                "clip": Windowed(copy.deepcopy(base), window, clip_grad_norm=CLIP),
                "no clip, fwd": Windowed(copy.deepcopy(base), window, overlap="forward")}
    losses = {name: [] for name in (*references, *trainers)}
    for x, y in batches[:3]:  # correctness before timing (fresh models: the timed ones stay untouched)
        for name, trainer in references.items():
            losses[name].append(trainer.step(x, y))
    times = {name: [] for name in trainers}
    watch = LoadWatch()
    for k, (x, y) in enumerate(batches):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            losses[name].append(trainer.step(x, y))
            times[name].append(time.perf_counter() - t0)
    load = watch.stop().fields()
    for name, ref in (("no clip", "plain"), ("clip", "plain clip"), ("no clip, fwd", "plain")):
        torch.testing.assert_close(torch.tensor(losses[name][:3]), torch.tensor(losses[ref]), rtol=1e-5, atol=0,
                                   msg=f"{name}: losses differ from {ref}")
    for trainer in (*references.values(), *trainers.values()):
        trainer.close()

    timed = {name: t[args.warmup:] for name, t in times.items()}
    rows = []
    for name, samples in timed.items():
        t = Timing.of(samples)
        vs_none, vs_fwd = paired_ratio(samples, timed["no clip"]), paired_ratio(samples, timed["no clip, fwd"])
        rows.append({"config": name, "step_ms": 1e3 * t.median_s, "p20_ms": 1e3 * t.p20_s, "p80_ms": 1e3 * t.p80_s,
                     "x_no_clip": vs_none.median, "x_no_clip (p20-p80)": vs_none.label(),
                     "x_no_clip_fwd": vs_fwd.median, "x_no_clip_fwd (p20-p80)": vs_fwd.label(), **load})
    norm_row = _norm_pass_row(base)
    title = (f"GPT {args.layers} blocks, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32, W={window}, "
             f"clip {CLIP}: {args.steps} timed steps after {args.warmup} warm-up (CPU backend); "
             "x_*: this step time / the other's, paired")
    hidden = ("load_start", "load_end", "loaded")
    print_table(rows, [c for c in rows[0] if c not in hidden], title)
    if norm_row is not None:
        print_table([norm_row], [c for c in norm_row if c not in hidden],
                    "host norm pass: native param_grad_norms / the torch.linalg.vector_norm loop, paired")
    write_json(args.json, "clip", rows, {"args": vars(args), "hyper": HYPER, "norm_pass": norm_row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
