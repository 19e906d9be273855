"""``--window auto``: measure one block on this machine, then let the planner's cost model choose
K (device-resident blocks), their recompute and W.

Before the first step, block 0 (GPT's, or a Hugging Face model's with random weights) is timed
forward and forward+backward at the run's (B, T) and precision, with its copies and both Adam
updates. Those seconds replace the analytic ones in the planner's ``BlockCosts`` and
``planner.plan.choose_split`` picks the best split that fits the device budget (on CUDA the free
memory less ``device_reserve_bytes``). ``--resident-blocks K`` fixes K. One cost model: the planner's.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from pystronghold.optim.functional import adam_step_
from pystronghold.optim.hyper import AdamWHyper
from pystronghold.options import ConfigError
from pystronghold.planner.cost import Workload, block_costs, BlockCosts
from pystronghold.planner.hardware import GPU, GiB, Hardware
from pystronghold.planner.memory import device_memory
from pystronghold.planner.plan import choose_split
from pystronghold.planner.timeline import StepTime
from pystronghold.planner.trainable import param_split
from pystronghold.runtime.memory.placement import available_host_bytes
from pystronghold.settings.precision import compute_dtype

__all__ = ["AutoWindow", "HFProbe", "measure_costs", "choose_runtime_window", "run_workload", "device_budget",
           "device_reserve_bytes", "DEVICE_RESERVE_FRACTION", "DEVICE_RESERVE_MIN_BYTES"]

log = logging.getLogger(__name__)

DEVICE_RESERVE_FRACTION = 0.08
"""Fraction of the device's total memory that ``--window auto`` keeps out of the budget on CUDA."""
DEVICE_RESERVE_MIN_BYTES = 2 * GiB
"""The least it keeps, bytes."""


def device_reserve_bytes(total_bytes: int) -> int:
    """Device bytes left out of the free memory ``--window auto`` plans with on a device of
    ``total_bytes``: max(``DEVICE_RESERVE_MIN_BYTES``, ``DEVICE_RESERVE_FRACTION`` of it).

    NOTE: the planner counts the window, head/tail, resident blocks and activations; what it does
    not count needs room too: the caching allocator's fragmentation, cuBLAS/cuDNN workspaces, the
    kernels' temporaries (the loss's fp32 copies of the logits), NCCL buffers and the probe's error."""
    return max(DEVICE_RESERVE_MIN_BYTES, int(DEVICE_RESERVE_FRACTION * total_bytes))


def device_budget(run) -> tuple[int, int, int] | None:
    """(budget, free, reserve): the device bytes the planner may fill for ``run`` (a
    ``train.run.Run``): ``--device-budget-mb`` (free and reserve 0), or a CUDA device's free memory
    less ``device_reserve_bytes``; None on the CPU backend without ``--device-budget-mb``."""
    if run.config.auto_window.device_budget_mb:
        return int(run.config.auto_window.device_budget_mb * 2**20), 0, 0
    device = torch.device(run.runtime.device)
    if device.type != "cuda":
        return None
    free, total = _free_device_bytes(device)
    reserve = device_reserve_bytes(total)
    return max(free - reserve, 0), free, reserve


def _free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the CUDA ``device`` once the probe's cached blocks are returned; the
    allocator's peak counter restarts, so the run's measured peak does not hold the probe's."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


@dataclass(slots=True)
class AutoWindow:
    """The decision of ``--window auto`` and the figures behind it."""

    window: int
    """W chosen (0 when every block is resident)."""
    max_window: int
    """Most slots that fit the device budget beside the resident blocks."""
    budget_bytes: int
    """Device budget the planner was given, bytes (the free memory less the reserve on CUDA)."""
    costs: BlockCosts
    """Measured per-block seconds, planner bytes."""
    step: StepTime
    """Simulated step time of this split."""
    resident_blocks: int = 0
    """K chosen (or as given by --resident-blocks)."""
    resident_recompute: bool = False
    """The resident blocks recompute in backward (the budget demanded it)."""
    blocks: int = 0
    """N, blocks of the model."""
    checkpointing: bool = True
    """The streamed blocks recompute (the runtime's default)."""
    work: Workload | None = None
    """The workload the planner was given (batch, seq, precision, overlap)."""
    free_bytes: int = 0
    """Free device memory seen before planning (0: not read, the budget was given or the device is the CPU)."""
    reserve_bytes: int = 0
    """Of the free memory, kept out of the budget (``device_reserve_bytes``; 0 when not read)."""
    predicted_peak_bytes: int = 0
    """The planner's device peak of this split: window, head/tail, resident blocks, and activations
    or the optimizer step's fp32 gradient copies (``planner.memory.DeviceMemory``)."""
    predicted_step_bytes: int = 0
    """The planner's device bytes of the optimizer step (no activations): what the CPU arena's
    measured peak is compared with."""

    def wrap_options(self) -> dict:
        """The split as ``wrap``'s options: W (K = N: ``"all"``), K and their recompute."""
        return dict(window=self.window or "all", resident_blocks=self.resident_blocks,
                    resident_recompute=self.resident_recompute)

    def peak_line(self, measured_bytes: int, steps: int, cuda: bool = True) -> str:
        """The measured device peak after ``steps`` steps (``train.metrics.device_peak_bytes``) beside
        the planner's; ``cuda`` False: the measured one leaves out the activations (CPU arena), and
        so does the planner's figure it is compared with (its optimizer step's)."""
        mib = 2**20
        predicted = self.predicted_peak_bytes if cuda else self.predicted_step_bytes
        ratio = measured_bytes / max(predicted, 1)
        what = "" if cuda else " (CPU arena: no activations)"
        return (f"window=auto: measured device peak{what} {measured_bytes / mib:.1f} MiB after {steps} steps, "
                f"predicted {predicted / mib:.1f} MiB ({ratio:.2f}x), "
                f"budget {self.budget_bytes / mib:.1f} MiB")

    def line(self) -> str:
        c, s, k = self.costs, self.step, self.resident_blocks
        streamed = self.blocks - k
        recomputed = (streamed if self.checkpointing else 0) + (k if self.resident_recompute else 0)
        mib = 2**20
        budget = (f"{self.budget_bytes / mib:.1f} MiB" if not self.free_bytes else
                  f"{self.budget_bytes / mib:.1f} MiB = {self.free_bytes / mib:.1f} MiB free less a "
                  f"{self.reserve_bytes / mib:.1f} MiB reserve")
        return (f"window=auto: {k} blocks resident with device AdamW ({k * c.resident_block_bytes / mib:.1f} MiB), "
                f"{streamed} streamed through W={self.window} slots ({self.window * c.slot_bytes / mib:.1f} MiB; "
                f"at most {self.max_window} fit {budget}), {recomputed} recomputed "
                f"(saving {recomputed * (c.block_activation_bytes - c.block_input_bytes) / mib:.1f} MiB); "
                f"per block measured fwd {c.fwd_s * 1e3:.2f} ms, bwd+recompute {c.bwd_s * 1e3:.2f} ms, "
                f"load {c.load_s * 1e3:.3f} ms, grad copy {c.grad_s * 1e3:.3f} ms, host Adam {c.adam_s * 1e3:.2f} ms, "
                f"device AdamW {c.device_adam_s * 1e3:.2f} ms, LM head + loss fwd+bwd {c.head_tail_s * 1e3:.2f} ms; "
                f"predicted device peak {self.predicted_peak_bytes / mib:.1f} MiB, "
                f"predicted step {s.total_s * 1e3:.1f} ms (compute {s.compute_s * 1e3:.1f}, exposed transfer "
                f"{s.exposed_transfer_s * 1e3:.1f}, exposed optimizer {s.exposed_optimizer_s * 1e3:.1f})")


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@dataclass(frozen=True, slots=True)
class HFProbe:
    """A Hugging Face model as ``--window auto`` measures and plans it."""

    shape: object
    """Its ``planner.hf_shape.HFShape`` (what the planner costs)."""
    model: nn.Module
    """The model (PEFT-wrapped under --lora-rank), head and tail loaded, blocks possibly on meta."""
    blocks: nn.ModuleList
    """Its block stack."""


class _BlockInputsSeen(Exception):
    """Raised by the hook that caught block 0's inputs: the model's forward stops there."""


def _hf_block_inputs(probe: HFProbe, batch: int, seq: int) -> tuple[tuple, dict]:
    """(args, kwargs) the model's own forward hands block 0 for a (batch, seq) batch of token 0s,
    on the host: hidden states, and what the family adds (rotary cos/sin, masks, positions). Only
    the embeddings run (the blocks may still be on meta)."""
    seen = {}

    def catch(_module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise _BlockInputsSeen

    hook = probe.blocks[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.zeros(batch, seq, dtype=torch.long))
    except _BlockInputsSeen:
        pass
    finally:
        hook.remove()
    if not seen:
        raise ValueError("--window auto: the model's forward did not call its first block; give --window N")
    return seen["args"], seen["kwargs"]


def _block_with_values(block: nn.Module, std: float) -> nn.Module:
    """A trainable copy of ``block``, its ``meta`` parameters (a lazily built model's) given random
    values: they do not matter to its timing."""
    block = copy.deepcopy(block).requires_grad_(True)
    with torch.no_grad():
        for module in block.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if p.is_meta:
                    setattr(module, name, nn.Parameter(torch.empty(p.shape).normal_(0.0, std)))
    return block


def measure_costs(model, work: Workload, device: torch.device, budget_bytes: int, reps: int = 3) -> BlockCosts:
    """``BlockCosts`` of ``model`` (a GPT, or a Hugging Face model's ``HFProbe``) with seconds
    measured on ``device`` (see the module doc)."""
    dtype = compute_dtype(work.precision)
    hf = isinstance(model, HFProbe)
    cfg = model.shape if hf else model.config
    seq = work.seq or cfg.seq_len
    # NOTE: timed as a trainable block even when it is frozen (--freeze): the full fine-tune's costs
    # bound a partial one's
    block = _block_with_values(model.blocks[0], std=0.02 if hf else cfg.init_std).to(device, dtype)
    if hf:
        args, kwargs = tree_map_only(  # floating inputs (hidden states, rotary tables) in the compute dtype
            torch.Tensor, lambda t: t.to(device, dtype) if t.is_floating_point() else t.to(device),
            _hf_block_inputs(model, work.batch, seq))
        if not args:  # the hidden states, passed by name: the first argument from here on
            args = (kwargs.pop("hidden_states"),)
    else:
        args, kwargs = (torch.randn(work.batch, seq, cfg.hidden, device=device, dtype=dtype),), {}  # (B, T, C)
    x, rest = args[0], args[1:]
    dy = torch.randn_like(x)

    def output(xi):  # a Hugging Face block may return a tuple, the hidden states first
        out = block(xi, *rest, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def fwd():
        with torch.no_grad():
            output(x)

    def bwd():  # the runtime recomputes the block's forward inside backward
        xg = x.detach().requires_grad_(True)
        # NOTE: allow_unused: an expert no token was routed to gets no gradient
        torch.autograd.grad(output(xg), [xg, *block.parameters()], dy, allow_unused=True)

    fwd_s, bwd_s = _timed(fwd, device, reps), _timed(bwd, device, reps)
    head_tail_s = _head_tail_seconds(cfg, work, device, reps)
    numel = sum(p.numel() for p in block.parameters())
    # what trains (work.finetune: LoRA adapters, unfrozen parameters) is what a gradient copy-out
    # and both Adams move; a load moves the whole block
    train_numel = max(1, sum(param_split(cfg, work.finetune).block_trainable))
    host = torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")
    dev = torch.zeros(numel, dtype=dtype, device=device)
    load_s = _timed(lambda: dev.copy_(host, non_blocking=True), device, reps)
    grad_s = _timed(lambda: host[:train_numel].copy_(dev[:train_numel], non_blocking=True), device, reps)
    p, g, m, v = (torch.zeros(train_numel) for _ in range(4))
    hyper = AdamWHyper(step=1, lr=1e-3, weight_decay=0.0)
    adam_s = _timed(lambda: adam_step_(p, g, m, v, hyper), torch.device("cpu"), reps)
    # the resident blocks' device AdamW (optim/device_adamw.DeviceAdamW: torch's, fused on CUDA)
    master = torch.zeros(train_numel, device=device, requires_grad=True)
    master.grad = torch.zeros_like(master)
    device_opt = torch.optim.AdamW([master], lr=1e-3, fused=device.type == "cuda")
    device_adam_s = _timed(device_opt.step, device, reps)
    nbytes = numel * dtype.itemsize
    gpu = GPU(name=f"{device.type} (measured)", memory_bytes=budget_bytes, fp32_flops=1e12, bf16_flops=1e12,
              fp16_flops=1e12, h2d_bytes_per_s=nbytes / max(load_s, 1e-9),
              d2h_bytes_per_s=train_numel * dtype.itemsize / max(grad_s, 1e-9))
    hw = Hardware(gpu=gpu, host_memory_bytes=available_host_bytes(),
                  cpu_adam_params_per_s=train_numel / max(adam_s, 1e-9))
    planned = block_costs(cfg, work, hw)  # bytes from the planner; seconds replaced by measurements
    return dataclasses.replace(planned, fwd_s=fwd_s, bwd_s=bwd_s, load_s=load_s, grad_s=grad_s,
                               adam_s=adam_s, head_tail_s=head_tail_s, device_adam_s=device_adam_s,
                               recompute_s=min(fwd_s, bwd_s) if work.checkpointing else 0.0)


def _head_tail_seconds(cfg, work: Workload, device: torch.device, reps: int) -> float:
    """Forward + backward of the LM head and the loss at the run's (B, T), seconds: the matmul of
    (B*T, C) by (C, V) and the cross-entropy, timed on ``device`` in the compute dtype, the weight's
    gradient taken unless the LM head is frozen (``param_split``). The embedding and final norm
    are left out (O(B*T*C), against the head's O(B*T*C*V))."""
    dtype = compute_dtype(work.precision)
    tokens = work.batch * (work.seq or cfg.seq_len)
    x = torch.randn(tokens, cfg.hidden, device=device, dtype=dtype, requires_grad=True)  # (B*T, C)
    w = torch.randn(cfg.padded_vocab_size, cfg.hidden, device=device, dtype=dtype)  # (V, C)
    w.requires_grad_(not param_split(cfg, work.finetune).lm_head_frozen)
    y = torch.randint(0, cfg.padded_vocab_size, (tokens,), device=device)

    def step():
        loss = torch.nn.functional.cross_entropy((x @ w.T).float(), y)
        torch.autograd.grad(loss, [x, w] if w.requires_grad else [x])

    return _timed(step, device, reps)


def run_workload(run, settings: dict | None = None) -> Workload:
    """The planner's ``Workload`` of ``run`` (a ``train.run.Run``): this process's
    micro-batch, the sequence, precision, overlap and fine-tune, the chunked loss and MLP tiles in
    effect, and head/tail on the host and block-input offload as ``settings`` (RuntimeConfig fields
    being decided, ``train.long_context``) or the run's runtime says ("auto", undecided, counts as
    off). No reserves: the budget it is planned in has them taken off already."""
    rt, settings, data = run.runtime, settings or {}, run.config.data
    offload = settings.get("offload_block_inputs", rt.offload_block_inputs)
    return Workload(batch=run.local_batch, seq=run.seq, precision=rt.precision,
                    overlap="forward" if rt.needs_global_grad else "backward",
                    device_reserve_bytes=0, host_reserve_bytes=0, finetune=run.config.finetune,
                    loss_chunk_tokens=None if data.loss_chunk == "auto" else data.loss_chunk,
                    mlp_tile_tokens=run.mlp_tile_tokens,
                    head_tail_on_host=settings.get("head_tail_on_host", rt.head_tail_on_host) is True,
                    offload_block_inputs=offload is not False and offload != "auto")


def choose_runtime_window(model, run, blocks: nn.ModuleList | None = None) -> AutoWindow:
    """K, the resident recompute and W for ``model`` trained as ``run`` (a ``train.run.Run``) within
    its device budget (K as given when ``--resident-blocks`` is > 0); logs the split and why.
    ``blocks``: the model's block stack (needed for a Hugging Face model, ``--model hf:DIR``).

    NOTE: here, after the model is built, not in ``resolve``: the split is measured on the
    model's own blocks (``measure_costs``)."""
    rt = run.runtime
    device = torch.device(rt.device)
    if run.hf:
        from pystronghold.planner.hf_shape import read_hf_shape

        model = HFProbe(shape=run.hf_shape or read_hf_shape(run.model.source), model=model, blocks=blocks)
    # NOTE: the device reserve is taken off the budget below (on CUDA) rather than added to the
    # planner's peak, so that the predicted peak is what the allocator's peak counter should see
    work = run_workload(run)
    n = len(model.blocks)
    probe = measure_costs(model, work, device, budget_bytes=1)
    base = device_memory(probe, work, n, 0, 1).peak_bytes  # head/tail + activations, no slot
    budget, free, reserve = device_budget(run) or (base + 4 * probe.slot_bytes, 0, 0)
    fixed = None if rt.resident_blocks in ("auto", 0) else rt.resident_blocks  # else K as given
    if fixed is not None and fixed > n:
        raise ConfigError(rt, "resident_blocks", f"({fixed}) is more than the model's {n} blocks")
    split = choose_split(probe, work, n, budget, resident=fixed)
    if split.step is None:
        given = f" ({free / 2**20:.1f} MiB free less a {reserve / 2**20:.1f} MiB reserve)" if free else ""
        raise ValueError(f"--window auto: the device budget {budget / 2**20:.1f} MiB{given} holds no block slot "
                         f"beside {fixed or 0} resident blocks (head/tail and activations need "
                         f"{base / 2**20:.1f} MiB, a slot {probe.slot_bytes / 2**20:.2f} MiB, a resident block "
                         f"{probe.resident_block_bytes / 2**20:.2f} MiB); raise --device-budget-mb")
    peak = device_memory(probe, work, n, split.window, budget, split.resident, split.resident_recompute)
    decision = AutoWindow(window=split.window, max_window=split.max_window, budget_bytes=budget, costs=probe,
                          step=split.step, resident_blocks=split.resident,
                          resident_recompute=split.resident_recompute, blocks=n, work=work,
                          free_bytes=free, reserve_bytes=reserve, predicted_peak_bytes=peak.peak_bytes,
                          predicted_step_bytes=peak.step_bytes)
    log.info("%s", decision.line())
    return decision
