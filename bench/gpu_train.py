"""GPU training benchmark: one GPT on the same batches, trained every way one device allows, side by side.

Configurations, each in a fresh state (the model re-created from the same seed, the allocator's
cache emptied, peak counters reset), in one process:
  plain            plain PyTorch, everything resident: bf16 autocast, torch.optim.AdamW(fused=True),
                   no recompute (the baseline)
  recompute        the same with torch.utils.checkpoint around each block
  W=all W=4 W=2    pystronghold.wrap with that many blocks on the device (bf16 weights, fp32 masters
                   and the fused CPU Adam on the host, recompute)
  W=auto           the split the planner picks from costs measured here, exactly as `train --window
                   auto` wraps it: K device-resident blocks (their recompute), W slots for the rest
  fsdp2-offload    torch FSDP2 (fully_shard per block and the root, one rank) with CPUOffloadPolicy
                   and a bf16 MixedPrecisionPolicy; torch.optim.AdamW on the host
  deepspeed-zero2  DeepSpeed ZeRO-2 with offload_optimizer to the CPU (DeepSpeedCPUAdam), when
                   deepspeed imports (skipped with a note otherwise)

Losses come first: every configuration's loss at every step (warm-up included) must be within the
precision's tolerance of plain's (LOSS_RTOL); a mismatch is printed in capitals and the exit status
is 1. Then per configuration: median step time (20/80% quantiles), tokens/s, TFLOP/s, peak device
memory (torch.cuda.max_memory_allocated) and the host's peak resident memory (VmHWM, reset through
/proc/self/clear_refs), both over the training steps (reset once the configuration is built).

TFLOP/s counts model FLOPs (recompute is not credited), as Megatron-LM (Narayanan et al. 2021,
eq. 3, without its recompute pass) and PaLM (Chowdhery et al. 2022, App. B) do:
    FLOPs per step = tokens * (6 * N + 12 * L * h * T)
N = the parameters that multiply activations (every block's + the LM head's V_padded * h; the
embedding lookups do no multiplications), L layers, h hidden width, T sequence length.

Without CUDA it prints one line and exits 0, unless given --device cpu, which runs the
configurations that work on the CPU (plain, recompute, the W variants; fp32) on the tiny preset
(FSDP2 too when named in --configs: a check of its code path, offloading nowhere).

    python bench/gpu_train.py                                    # gpt3-1.3b, bf16, batch 4 x 2048
    python bench/gpu_train.py --model gpt3-350m --batch 8 --configs plain,W=2 --json out.json
    python bench/gpu_train.py --device cpu --steps 2 --warmup 0  # the CPU subset, tiny model
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Timing, TorchTrainer, WrappedTrainer, host_peak_bytes, print_table, reset_host_peak,  # noqa: E402
                    write_json)

import pystronghold as ph  # noqa: E402
from pystronghold.models import GPT, block_param_count, param_count  # noqa: E402
from pystronghold.train.model_spec import resolve_model  # noqa: E402

HYPER = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = ("plain", "recompute", "W=all", "W=4", "W=2", "W=auto", "fsdp2-offload", "deepspeed-zero2")
DISTRIBUTED = ("fsdp2-offload", "deepspeed-zero2")  # need a (one-rank) process group
LOSS_RTOL = {"fp32": 1e-4, "bf16": 1e-2}
"""Relative tolerance of each step's loss against plain's. fp32: summation orders differ (fused
device AdamW against the host's fused Adam; measured 6e-8 on an H100). bf16: plain's autocast keeps
fp32 weights and runs norms in fp32, the others compute with bf16 weights; 1e-2 is 2.5 units of
bf16's 2^-8 rounding (measured 6e-5 for W=all on an H100)."""


# ---- the ways to train

class Plain(TorchTrainer):
    """Plain PyTorch, resident; ``recompute`` wraps each block in torch.utils.checkpoint."""

    def __init__(self, model, device, precision, recompute=False) -> None:
        model = model.to(device)
        autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16"
                    else contextlib.nullcontext)
        super().__init__(model, torch.optim.AdamW(model.parameters(), fused=True, **HYPER), autocast=autocast)
        self.recompute = recompute

    def loss(self, x, y):
        m = self.model
        if not self.recompute:
            return m(x, y)
        from torch.utils.checkpoint import checkpoint

        h = m.head(x)  # (B, T, C)
        for block in m.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return m.tail(h, y)


class Windowed(WrappedTrainer):
    """pystronghold.wrap with ``window`` slots on the device (and ``split``: K resident blocks, their
    recompute)."""

    def __init__(self, model, device, precision, window, **split) -> None:
        super().__init__(ph.wrap(model, blocks=model.blocks, window=window, device=str(device),
                                 precision=precision, optimizer=ph.AdamW(**HYPER), **split))
        self.window = self.engine.window_size
        self.resident_blocks = self.engine.stats()["resident_blocks"]
        self.resident_recompute = self.engine.config.resident_recompute


def auto_split(model, args) -> tuple[dict, float]:
    """``wrap``'s options (W, K, the resident recompute) as ``pystronghold train --window auto``
    chooses and passes them for this model and batch, here (without clipping, as the bench trains),
    and the planner's predicted step, seconds."""
    from pystronghold.train.autowindow import choose_runtime_window
    from pystronghold.runtime.config import RuntimeConfig
    from pystronghold.train.config import DataOptions, ModelOptions, TrainConfig
    from pystronghold.train.run import resolve

    config = TrainConfig(model=ModelOptions(model=args.model), data=DataOptions(batch=args.batch, seq=args.seq),
                         runtime=RuntimeConfig(window="auto", device=args.device, precision=args.precision))
    decision = choose_runtime_window(model, resolve(config))
    return decision.wrap_options(), decision.step.total_s


class FSDP2Offload(TorchTrainer):
    """torch FSDP2 on one rank: parameters, gradients and AdamW states on the host (CPUOffloadPolicy)."""

    def __init__(self, model, device, precision) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
                       offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda"))
        for block in model.blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)  # head and tail (the tied embedding) in the root's group
        # the sharded parameters live on the host
        super().__init__(model, torch.optim.AdamW(model.parameters(), **HYPER))


class DeepSpeedZero2:
    """DeepSpeed ZeRO-2 with the optimizer (fp32 masters, moments, DeepSpeedCPUAdam) on the host."""

    def __init__(self, model, device, precision, batch) -> None:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": precision == "bf16"}, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "contiguous_gradients": True, "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "betas": list(HYPER["betas"]),
                                                      "eps": HYPER["eps"], "weight_decay": HYPER["weight_decay"]}},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model.to(device), model_parameters=model.parameters(),
                                               config=config, dist_init_required=False)

    def step(self, x, y) -> float:
        loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def close(self) -> None:
        if hasattr(self.engine, "destroy"):  # DeepSpeed >= 0.14 frees its hooks and buffers here
            self.engine.destroy()


def skip_reason(name: str, device: torch.device, named: bool) -> str | None:
    """Why ``name`` does not run here, or None; ``named``: the user listed it in --configs."""
    if name == "fsdp2-offload" and device.type != "cuda" and not named:
        return ("offloading from the CPU to the CPU measures nothing (name it in --configs to run it "
                "as a check of the code path)")
    if name == "deepspeed-zero2" and device.type != "cuda":
        return "needs CUDA (ZeRO-Offload keeps the model on a GPU)"
    if name == "deepspeed-zero2":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "deepspeed is not installed (pip install deepspeed)"
    return None


def make_trainer(name: str, model, args, device):
    if name in ("plain", "recompute"):
        return Plain(model, device, args.precision, recompute=name == "recompute")
    if name.startswith("W="):
        w = name[2:]
        if w != "auto":
            return Windowed(model, device, args.precision, window=w if w == "all" else int(w))
        split, predicted_s = auto_split(model, args)
        trainer = Windowed(model, device, args.precision, **split)
        trainer.predicted_step_s = predicted_s
        return trainer
    if name == "fsdp2-offload":
        return FSDP2Offload(model, device, args.precision)
    return DeepSpeedZero2(model, device, args.precision, args.batch)


# ---- measuring

def matmul_params(cfg) -> int:
    """N of the FLOP count: every block's parameters plus the LM head's (padded vocabulary x hidden)."""
    return cfg.layers * block_param_count(cfg) + cfg.padded_vocab_size * cfg.hidden


def model_flops_per_step(cfg, batch: int, seq: int) -> float:
    """tokens * (6 N + 12 L h T) (see the module docstring)."""
    return batch * seq * (6 * matmul_params(cfg) + 12 * cfg.layers * cfg.hidden * seq)


def fresh_state(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_config(name: str, cfg, batches, args, device) -> dict:
    """Train ``cfg`` from seed 0 on ``batches`` the ``name`` way; losses, step seconds, and the
    device and host peaks while training (what stays allocated from construction counts, its
    transients do not: FSDP2 moves the whole fp32 model through the device once while sharding)."""
    fresh_state(device)
    trainer = make_trainer(name, GPT(cfg, seed=0), args, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    host_reset = reset_host_peak()
    losses, seconds = [], []
    try:
        for x, y in batches:
            t0 = time.perf_counter()
            losses.append(trainer.step(x, y))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    return {"config": name, "window": getattr(trainer, "window", None),
            "resident_blocks": getattr(trainer, "resident_blocks", None),
            "resident_recompute": getattr(trainer, "resident_recompute", None),
            "predicted_step_s": getattr(trainer, "predicted_step_s", None), "losses": losses,
            "seconds": seconds[args.warmup:],
            "device_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "host_peak_bytes": host_peak_bytes(), "host_peak_is_per_config": host_reset}


def check_losses(runs: dict) -> dict[str, float]:
    """Largest relative difference of each run's losses from plain's (plain must be among them)."""
    ref = torch.tensor(runs["plain"]["losses"], dtype=torch.float64)
    return {name: float(((torch.tensor(r["losses"], dtype=torch.float64) - ref).abs() / ref.abs()).max())
            for name, r in runs.items()}


def init_single_rank(device: torch.device) -> None:
    """A one-rank process group for FSDP2 and DeepSpeed (a file store: no port to find)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":  # NCCL's one rank uses this device ("cuda" alone: the current one)
        torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)
    for key in ("RANK", "LOCAL_RANK"):  # DeepSpeed reads them
        os.environ.setdefault(key, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    store = tempfile.NamedTemporaryFile(prefix="gpu_train_pg_", delete=False).name
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{store}", rank=0, world_size=1)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[-4:]))
    parser.add_argument("--device", default="cuda", help="'cuda[:n]' (default) or 'cpu' (the CPU subset)")
    parser.add_argument("--model", default=None, help="a preset (pystronghold plan --help); default gpt3-1.3b "
                        "on CUDA, tiny on the CPU")
    parser.add_argument("--precision", default=None, choices=sorted(LOSS_RTOL),
                        help="default bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 on CUDA, 2 on CPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (their losses are checked)")
    parser.add_argument("--configs", default=None, help=f"comma-separated subset of {','.join(CONFIGS)} "
                        "(default: all; plain always runs, as the reference)")
    parser.add_argument("--quick", action="store_true", help="gpt3-125m, batch 4 x 1024, 5 steps after 2")
    parser.add_argument("--json", default=None, help="write the records here")
    args = parser.parse_args(argv)
    on_cpu = args.device == "cpu"
    if args.quick:
        args.model, args.batch, args.seq, args.steps, args.warmup = args.model or "gpt3-125m", args.batch or 4, \
            args.seq or 1024, 5, 2
    args.model = args.model or ("tiny" if on_cpu else "gpt3-1.3b")
    args.precision = args.precision or ("fp32" if on_cpu else "bf16")
    args.batch = args.batch or (2 if on_cpu else 4)
    try:
        cfg = resolve_model(args.model)
    except ValueError as err:
        parser.error(str(err))
    args.seq = args.seq or cfg.seq_len
    args.named_configs = args.configs is not None
    configs = [c.strip() for c in (args.configs or ",".join(CONFIGS)).split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        parser.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    args.configs = ["plain"] + [c for c in configs if c != "plain"]  # the reference always runs
    if args.seq > cfg.seq_len or args.seq < 1 or args.batch < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"need 1 <= --seq <= {cfg.seq_len}, --batch >= 1, --steps >= 1, --warmup >= 0")
    return args, cfg


# ---- the report

def report_losses(runs: dict, diffs: dict, rtol: float, precision: str) -> list[str]:
    """Print every configuration's losses against plain's; return the names that differ (loudly)."""
    bad = [name for name, d in diffs.items() if not d <= rtol]
    steps = len(runs["plain"]["losses"])
    print_table([{"config": n, "first_loss": r["losses"][0], "last_loss": r["losses"][-1],
                  "max_rel_diff": f"{diffs[n]:.2e}", "status": "LOSS MISMATCH" if n in bad else "ok"}
                 for n, r in runs.items()],
                ["config", "first_loss", "last_loss", "max_rel_diff", "status"],
                f"losses at each of {steps} steps against plain's (tolerance {rtol:g} relative, {precision})")
    for name in bad:
        print(f"!!! {name}: LOSSES DIFFER FROM PLAIN PYTORCH by {diffs[name]:.2e} relative (> {rtol:g}); "
              "its figures below do not count")
    return bad


def timing_rows(runs: dict, diffs: dict, bad: list[str], cfg, args) -> list[dict]:
    """One record per configuration: step time, throughput, peaks, and its losses."""
    flops, tokens = model_flops_per_step(cfg, args.batch, args.seq), args.batch * args.seq
    t_plain = Timing.of(runs["plain"]["seconds"]).median_s
    rows = []
    for name, r in runs.items():
        t = Timing.of(r["seconds"])
        dev = r["device_peak_bytes"]
        rows.append({"config": name, "W": r["window"] or "-", "K": "-" if r["resident_blocks"] is None
                     else r["resident_blocks"], "resident_recompute": r["resident_recompute"], "step_ms": 1e3 * t.median_s,
                     "predicted_step_ms": None if r["predicted_step_s"] is None else 1e3 * r["predicted_step_s"],
                     "p20_ms": 1e3 * t.p20_s, "p80_ms": 1e3 * t.p80_s, "vs_plain": t.median_s / t_plain,
                     "tokens_per_s": tokens / t.median_s, "tflops": flops / t.median_s / 1e12,
                     "device_peak_GiB": "-" if dev is None else dev / 2**30,
                     "host_peak_GiB": r["host_peak_bytes"] / 2**30,
                     "losses_ok": name not in bad, "max_rel_loss_diff": diffs[name], "losses": r["losses"]})
    return rows


# ---- the run

def main(argv=None) -> int:
    args, cfg = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"bench/gpu_train.py: no CUDA device (torch {torch.__version__}); --device cpu: CPU subset")
        return 0
    logging.basicConfig(level=logging.WARNING)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(device)
                     for _ in range(2)) for _ in range(args.warmup + args.steps)]
    runs, skipped, failed = {}, {}, {}
    rtol = LOSS_RTOL[args.precision]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU backend"

    def save(rows: list[dict], done: bool) -> None:
        """The JSON after every configuration (``complete`` False until the last): a run killed at a
        lent GPU's timeout keeps the configurations it finished."""
        write_json(args.json, "gpu_train", rows, {
            "args": vars(args), "device": where, "loss_rtol": rtol, "skipped": skipped, "failed": failed,
            "complete": done, "flops_per_step": model_flops_per_step(cfg, args.batch, args.seq),
            "flops_formula": "tokens * (6 * (layers * block_params + padded_vocab * hidden) + 12 * layers * hidden * seq)"})

    for name in args.configs:
        reason = skip_reason(name, device, named=args.named_configs)
        if reason is not None:
            skipped[name] = reason
            print(f"{name}: skipped: {reason}")
            continue
        print(f"{name}: {args.warmup} + {args.steps} steps ...", flush=True)
        try:
            if name in DISTRIBUTED:
                init_single_rank(device)
            runs[name] = run_config(name, cfg, batches, args, device)
        except Exception as err:  # noqa: BLE001 - one configuration failing (e.g. out of memory) must
            # not cost the others their figures on a GPU lent for minutes; it is reported and fails the run
            if name == "plain":
                raise
            failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
            print(f"!!! {name}: FAILED: {failed[name]}", flush=True)
        if name in runs:
            diffs = check_losses(runs)
            rows = timing_rows(runs, diffs, [n for n, d in diffs.items() if not d <= rtol], cfg, args)
            row = rows[-1]
            print(f"{name}: {row['step_ms']:.1f} ms/step ({row['vs_plain']:.2f}x plain's time), "
                  f"{row['tflops']:.1f} TFLOP/s, losses {diffs[name]:.1e} from plain's", flush=True)
            save(rows, done=False)

    diffs = check_losses(runs)
    bad = report_losses(runs, diffs, rtol, args.precision)  # correctness first
    rows = timing_rows(runs, diffs, bad, cfg, args)
    title = (f"{args.model} ({param_count(cfg) / 1e6:,.1f}M params), {args.precision}, batch {args.batch} x "
             f"{args.seq}, {args.steps} timed steps after {args.warmup}, {where}; TFLOP/s = tokens * (6 N + "
             f"12 L h T) / step time, N = {matmul_params(cfg) / 1e6:,.1f}M")
    print_table(rows, ["config", "W", "K", "step_ms", "p20_ms", "p80_ms", "vs_plain", "tokens_per_s", "tflops",
                       "device_peak_GiB", "host_peak_GiB"], title)
    if not all(r["host_peak_is_per_config"] for r in runs.values()):
        print("note: /proc/self/clear_refs refused a reset: host peaks are the process's peak so far")
    for name, reason in skipped.items():
        print(f"note: {name} skipped: {reason}")
    for name, error in failed.items():
        print(f"!!! {name} FAILED: {error}")
    save(rows, done=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
