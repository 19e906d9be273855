"""What the safety checks cost, each against the work it sits beside, paired in one process.

- ``finite-check``: a checkpoint refuses inf/NaN state, checking every tensor of a block
  (``check_finite_state``) before writing it. Baseline: serialising and hashing the same block, the
  least a save does with it (the write and fsync come on top). Block: a GPT block of ``--hidden``
  (master + two Adam moments, fp32).
- ``side-outputs``: in a training forward each streamed block runs under a ``Watch`` (a global
  module forward hook noting the tensors its submodules return, so a hooked-out router logit can
  be carried out of the block). Baseline: the same training steps with the watch replaced by a
  no-op, on a copy of the same Hugging Face Llama (no side outputs, so both compute the same
  losses, checked first).

Reported: paired ratios (candidate time / baseline time as overhead; median and p20-p80). Nothing
here asserts a time.

    .venv/bin/python bench/safety_costs.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIN_PAIRS, LoadWatch, hf_llama, interleave, paired_ratio, print_table, write_json  # noqa: E402

import pystronghold as ph  # noqa: E402
from pystronghold.runtime.blocks import block_fn  # noqa: E402
from pystronghold.runtime.optimizer.divergence import check_finite_state  # noqa: E402


def block_states(hidden: int) -> dict[str, torch.Tensor]:
    """A GPT block's fp32 master and Adam moments: 12 h^2 + 13 h parameters, three tensors each."""
    shapes = {"attn.qkv.weight": (3 * hidden, hidden), "attn.qkv.bias": (3 * hidden,),
              "attn.proj.weight": (hidden, hidden), "attn.proj.bias": (hidden,),
              "mlp.fc.weight": (4 * hidden, hidden), "mlp.fc.bias": (4 * hidden,),
              "mlp.proj.weight": (hidden, 4 * hidden), "mlp.proj.bias": (hidden,),
              "ln1.weight": (hidden,), "ln1.bias": (hidden,), "ln2.weight": (hidden,), "ln2.bias": (hidden,)}
    g = torch.Generator().manual_seed(0)
    return {name + suffix: torch.randn(shape, generator=g)
            for name, shape in shapes.items() for suffix in ("", ".exp_avg", ".exp_avg_sq")}


def finite_check(hidden: int, rounds: int) -> dict:
    from safetensors.torch import save as st_save

    tensors = block_states(hidden)
    times = interleave({"serialise": lambda: hashlib.sha256(st_save(tensors)).digest(),
                        "check": lambda: check_finite_state(tensors, step=1, where="bench")}, rounds=rounds)
    r = paired_ratio(times["check"], times["serialise"])  # check / serialise
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    return {"subject": "finite-check", "size": f"{mib:.0f} MiB block",
            "baseline_ms": 1e3 * times["serialise"].median_s, "candidate_ms": 1e3 * times["check"].median_s,
            "ratio": r.median, "ratio_p20": r.p20, "ratio_p80": r.p80}


class _NoWatch(contextlib.nullcontext):
    """The watch's interface, seeing nothing: the baseline without side-output tracking."""

    def __init__(self, *args) -> None:
        super().__init__()

    def escaped(self, *args) -> list:
        return []


def side_outputs(layers: int, hidden: int, seq: int, rounds: int) -> dict:
    base = hf_llama(layers, hidden)
    g = torch.Generator().manual_seed(1)
    engines = {name: ph.wrap(copy.deepcopy(base), window=2, optimizer=ph.AdamW(lr=1e-4)) for name in ("off", "on")}
    x = torch.randint(0, 512, (2, seq), generator=g)

    def step(name: str) -> float:
        watch = block_fn.Watch
        if name == "off":  # NOTE: the module's own name swapped for this call only
            block_fn.Watch = _NoWatch
        try:
            engine = engines[name]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            return loss.item()
        finally:
            block_fn.Watch = watch

    for _ in range(2):
        assert step("off") == step("on"), "the watch changed the losses of a model without side outputs"
    times = interleave({"off": lambda: step("off"), "on": lambda: step("on")}, rounds=rounds)
    for engine in engines.values():
        engine.close()
    r = paired_ratio(times["on"], times["off"])  # on / off
    return {"subject": "side-outputs", "size": f"Llama {layers}x{hidden}, seq {seq}",
            "baseline_ms": 1e3 * times["off"].median_s, "candidate_ms": 1e3 * times["on"].median_s,
            "ratio": r.median, "ratio_p20": r.p20, "ratio_p80": r.p80}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="the checked block's hidden size")
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    if args.rounds < MIN_PAIRS:
        parser.error(f"--rounds {args.rounds}: at least {MIN_PAIRS} are needed")
    rows = []
    for measure in (lambda: finite_check(args.hidden, args.rounds),
                    lambda: side_outputs(args.llama_layers, args.llama_hidden, args.seq, args.rounds)):
        watch = LoadWatch()
        row = measure()
        load = watch.stop()
        rows.append({**row, **load.fields()})
    print_table(rows, ["subject", "size", "baseline_ms", "candidate_ms", "ratio", "ratio_p20", "ratio_p80", "load"],
                "candidate time / baseline time, paired (finite-check: the check as a share of serialising "
                "the block; side-outputs: a training step with the watch / without)")
    write_json(args.json, "safety_costs", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
