"""Fine-tuning with frozen weights: one Hugging Face Llama trained in full and with frozen parts,
through the window and beside plain PyTorch, all in one process, on the CPU backend.

Configurations (the same initial weights, the same batches, the same AdamW hyper-parameters):
  plain full / ours full          every parameter trains: plain PyTorch + torch.optim.AdamW, and
                                  ``ph.wrap`` with W blocks in the window
  plain freeze / ours freeze      the bottom half of the blocks frozen (``requires_grad=False``, as
                                  the CLI's ``--freeze``)
  plain LoRA / ours LoRA          PEFT LoRA (r=16, alpha 32) on q_proj and v_proj, the base frozen
  accelerate LoRA                 the plain LoRA model with Accelerate's CPU offload of its frozen
                                  base: ``accelerate.cpu_offload(module, execution_device=cpu)`` on
                                  every module whose own parameters are all frozen (what a
                                  ``device_map`` with "cpu" entries does to those modules; the
                                  adapters stay put, as the optimizer holds them)
Correctness first: every configuration's losses against its plain PyTorch reference (accelerate's
against ours LoRA's) to ``LOSS_RTOL``; no figure is reported when one differs more. Then, from the
same steps, taken in turns: step time (median, p20-p80) and paired ratios; host bytes per block
parameter (the store, ``engine.stats()``); link bytes per step (the trace's h2d and d2h copies; on
the CPU backend host-to-host copies between the store and the window's arena); device bytes of
parameters, gradients and optimizer states (activations aside; ours: window arena, resident
blocks, head and tail).

On a CPU-only machine Accelerate's execution device is the CPU where its offloaded weights already
are: its hooks rebind every frozen weight at every forward and drop it after, but the "copy" is a
no-op, so its row measures the hooks' overhead, not a transfer. Its ``h2d`` and ``device`` columns
are counted as on a GPU: the offloaded modules' parameters at each of their forwards, and the
adapters' states plus the onloaded weights autograd keeps from forward to backward.

    .venv/bin/python bench/finetune.py --json bench/results/finetune.json    # 8 x 512, seq 128, batch 2
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MIN_PAIRS, LoadWatch, Timing, TorchTrainer, WrappedTrainer, hf_llama, paired_ratio,  # noqa: E402
                    print_table, write_json)
from window import HYPER  # noqa: E402

import pystronghold as ph  # noqa: E402
from pystronghold.runtime.memory.layout import head_tail_bytes  # noqa: E402

LOSS_RTOL = 1e-5
"""Largest relative loss difference accepted against the reference (fp32; the fused host Adam is not
bit for bit torch's, ``bitwise_torch=False``, so last bits differ)."""

LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])


# ---- the trainers


class Plain(TorchTrainer):
    """Plain PyTorch (+ PEFT) with torch.optim.AdamW over the trainable parameters."""

    def __init__(self, model) -> None:
        super().__init__(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER))

    def loss(self, x):
        return self.model(input_ids=x, labels=x).loss

    def begin_timing(self) -> None:
        pass

    def figures(self, steps: int, x) -> dict:
        """Device bytes: every parameter resident, a trainable one with its gradient and moments."""
        return {"device_MB": head_tail_bytes(list(self.model.parameters()), torch.float32) / 1e6}


class Ours(WrappedTrainer):
    """The same model through ``ph.wrap`` (blocks found by discovery, PEFT's wrappers included)."""

    def __init__(self, model, window: int) -> None:
        super().__init__(ph.wrap(model, window=window, optimizer=ph.AdamW(**HYPER), trace=True))

    def loss(self, x):
        return self.engine(input_ids=x, labels=x).loss

    def begin_timing(self) -> None:
        self.engine.synchronize()
        self.engine.trace.clear()

    def figures(self, steps: int, x) -> dict:
        """Host store bytes per block parameter (all, and frozen ones alone), link bytes per step and
        device bytes (window arena, resident blocks, head and tail)."""
        engine = self.engine
        engine.synchronize()
        stats, moved = engine.stats(), engine.trace.summary().bytes
        head_tail = sum(p.numel() for p in engine.head_tail_params)
        block_params = stats["trainable_params"] + stats["frozen_params"] - head_tail
        frozen_block = stats["frozen_params"] - sum(p.numel() for p in engine.head_tail_params
                                                     if not p.requires_grad)
        return {"host_B/param": stats["store_bytes"] / block_params,
                "frozen_B/param": stats["store_frozen_bytes"] / frozen_block if frozen_block else "-",
                "h2d_MB/step": moved.get("h2d", 0) / steps / 1e6, "d2h_MB/step": moved.get("d2h", 0) / steps / 1e6,
                "device_MB": (stats["arena_used_bytes"] + stats["resident_bytes"]
                              + head_tail_bytes(engine.head_tail_params, torch.float32)) / 1e6}


class AccelerateOffload(Plain):
    """Plain PEFT training with ``accelerate.cpu_offload`` on every module whose own parameters are
    all frozen; counts the bytes its hooks bring to the execution device."""

    def __init__(self, model) -> None:
        import accelerate

        self.onloaded_bytes = 0
        self.offloaded = {}  # storage address -> bytes of every offloaded weight
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own and not any(p.requires_grad for p in own):
                self.offloaded.update({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in own})
                nbytes = sum(p.numel() * p.element_size() for p in own)
                module.register_forward_pre_hook(lambda *_, n=nbytes: self._count(n))
                accelerate.cpu_offload(module, execution_device=torch.device("cpu"))
        super().__init__(model)

    def _count(self, nbytes: int) -> None:
        self.onloaded_bytes += nbytes

    def begin_timing(self) -> None:
        self.onloaded_bytes = 0

    def held_bytes(self, x) -> int:
        """Bytes of offloaded weights that autograd keeps from a training forward until its backward:
        on a GPU their onloaded copies stay on the device until then (one untimed forward, counted
        through the saved-tensor hooks; on the CPU the onloaded tensor shares the offloaded one's
        storage)."""
        held = set()

        def pack(t):
            if t.untyped_storage().data_ptr() in self.offloaded:
                held.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.model(input_ids=x, labels=x)
        return sum(self.offloaded[ptr] for ptr in held)

    def figures(self, steps: int, x) -> dict:
        """Counted as on a GPU: H2D bytes per step of the hooks; device bytes of the adapters and
        their states, and of the onloaded frozen weights autograd holds until backward."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return {"h2d_MB/step": self.onloaded_bytes / steps / 1e6, "d2h_MB/step": 0.0,
                "device_MB": (head_tail_bytes(trainable, torch.float32) + self.held_bytes(x)) / 1e6}


# ---- the models


def models(args) -> dict:
    """name -> a fresh copy of its model: the full one, the half-frozen one and the LoRA one (when
    peft is installed), all from the same initial weights."""
    base = hf_llama(args.layers, args.hidden, positions=max(256, args.seq))

    def half_frozen():
        model = copy.deepcopy(base)
        for block in model.model.layers[:args.layers // 2]:
            block.requires_grad_(False)
        return model

    made = {"full": lambda: copy.deepcopy(base), "freeze": half_frozen}
    try:
        import peft
    except ImportError:
        print("peft is not installed: no LoRA configurations (pip install 'pystronghold[peft]')")
        return made
    torch.manual_seed(1)  # the adapters' initial A
    lora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**LORA))
    made["LoRA"] = lambda: copy.deepcopy(lora)
    return made


@dataclass
class Run:
    """One configuration: its trainer, the configuration its losses are checked against and the one
    its step time is paired with (None for a plain reference), and its parameters in millions."""

    trainer: object
    reference: str | None
    baseline: str | None
    trainable_m: float
    frozen_m: float


def runs_of(args) -> dict[str, Run]:
    """Every configuration, by name (the order in which they take turns)."""
    made = models(args)
    out = {}
    for kind, make in made.items():
        model = make()
        counts = (sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,
                  sum(p.numel() for p in model.parameters() if not p.requires_grad) / 1e6)
        out[f"plain {kind}"] = Run(Plain(model), None, None, *counts)
        out[f"ours {kind}"] = Run(Ours(make(), args.window), f"plain {kind}", f"plain {kind}", *counts)
        if kind == "LoRA":
            try:
                out["accelerate LoRA"] = Run(AccelerateOffload(make()), "ours LoRA", "plain LoRA", *counts)
            except ImportError:
                print("accelerate is not installed: no Accelerate offload configuration")
    return out


def max_rel_diff(got: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--window", type=int, default=2, help="W, blocks in the window")
    parser.add_argument("--steps", type=int, default=MIN_PAIRS, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    if args.steps < MIN_PAIRS:
        parser.error(f"--steps {args.steps}: the paired ratios need at least {MIN_PAIRS} timed steps")
    if args.layers < 2:
        parser.error(f"--layers {args.layers}: at least 2, so that half of the blocks can be frozen")
    logging.basicConfig(level=logging.WARNING)
    # NOTE: peft reads transformers' deprecated is_gradient_checkpointing; not ours to fix
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
    if args.threads:
        torch.set_num_threads(args.threads)

    runs = runs_of(args)
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 512, (args.batch, args.seq), generator=g) for _ in range(args.warmup + args.steps)]
    losses = {name: [] for name in runs}
    times = {name: [] for name in runs}
    # NOTE: configurations take turns step by step, so load from other users of a shared machine
    # falls on all of them alike.
    watch = LoadWatch()
    for k, x in enumerate(batches):
        for name, run in runs.items():
            if k == args.warmup:
                run.trainer.begin_timing()
            t0 = time.perf_counter()
            losses[name].append(run.trainer.step(x))
            times[name].append(time.perf_counter() - t0)
    load = watch.stop().fields()

    diffs = {name: max_rel_diff(losses[name], losses[run.reference]) for name, run in runs.items() if run.reference}
    print_table([{"config": name, "reference": runs[name].reference, "loss_max_rel_diff": f"{d:.1e}"}
                 for name, d in diffs.items()], ["config", "reference", "loss_max_rel_diff"],
                f"losses first: {args.warmup + args.steps} steps, each against its reference (tolerance {LOSS_RTOL:g})")
    bad = {name: d for name, d in diffs.items() if d > LOSS_RTOL}
    if bad:
        print(f"losses differ beyond {LOSS_RTOL:g} relative: {bad}; no figures reported")
        for run in runs.values():
            run.trainer.close()
        return 1

    timed = {name: times[name][args.warmup:] for name in runs}
    rows = []
    for name, run in runs.items():
        t, baseline = Timing.of(timed[name]), run.baseline
        row = {"config": name, "trainable_M": run.trainable_m, "frozen_M": run.frozen_m, "host_B/param": "-",
               "frozen_B/param": "-", "h2d_MB/step": "-", "d2h_MB/step": "-",
               **run.trainer.figures(args.steps, batches[0]),
               "step_ms": 1e3 * t.median_s, "p20_ms": 1e3 * t.p20_s, "p80_ms": 1e3 * t.p80_s,
               "baseline": baseline or "-", "x_baseline": "-", "x_baseline (p20-p80)": "-",
               "reference": run.reference or "-", "loss_max_rel_diff": diffs.get(name, 0.0)}
        if baseline:
            r = paired_ratio(timed[baseline], timed[name])
            row.update({"x_baseline": r.median, "x_baseline_p20": r.p20, "x_baseline_p80": r.p80,
                        "x_baseline (p20-p80)": r.label()})
        if name.startswith("ours ") and name != "ours full":
            r = paired_ratio(timed["ours full"], timed[name])
            row.update({"x_ours_full": r.median, "x_ours_full_p20": r.p20, "x_ours_full_p80": r.p80})
        if name == "ours LoRA" and "accelerate LoRA" in runs:
            r = paired_ratio(timed["accelerate LoRA"], timed[name])
            row.update({"x_accelerate": r.median, "x_accelerate_p20": r.p20, "x_accelerate_p80": r.p80})
        rows.append({**row, **load})
        run.trainer.close()
    title = (f"Llama {args.layers} x {args.hidden} (FFN {4 * args.hidden}), seq {args.seq}, batch {args.batch}, "
             f"fp32, W={args.window}, {args.steps} timed steps after {args.warmup} warm-up, taking turns "
             "(CPU backend; x_baseline: baseline step time / this one's, paired)")
    shown = ["config", "trainable_M", "frozen_M", "host_B/param", "frozen_B/param", "h2d_MB/step", "d2h_MB/step",
             "device_MB", "step_ms", "p20_ms", "p80_ms", "baseline", "x_baseline (p20-p80)", "load"]
    print_table(rows, shown, title)
    for row in rows:
        for key, versus in (("x_ours_full", "ours full"), ("x_accelerate", "accelerate LoRA")):
            if key in row:
                print(f"{row['config']} vs {versus}: {row[key]:.2f}x ({row[key + '_p20']:.2f}-{row[key + '_p80']:.2f}) "
                      "faster (paired step times)")
    write_json(args.json, "finetune", rows, {"args": vars(args), "hyper": HYPER, "lora": LORA,
                                             "loss_rtol": LOSS_RTOL})
    return 0


if __name__ == "__main__":
    sys.exit(main())
