"""The engine: runs the schedule from inside each block's autograd Function, and the optimizer step.

Per pass (forward, then backward when training) the engine walks the plan of ``schedule.py``:
``enter(block)`` before a block computes (issue what is pending, wait for its load, bind its
parameters to the slot), ``leave(block)`` after (in backward: gradients into the slot's flat
buffer, one copy-out, a host job; then the plan's releases and prefetch loads). A load of block i
is issued only after block i's last host update has finished, and into a slot only after that
slot's previous copy-out (and compute) finished. See docs/DESIGN.md "Window runtime".
"""

from __future__ import annotations

import logging

import torch

from pystronghold.io.scratch import check_io_directory
from pystronghold.runtime import block_fn
from pystronghold.runtime.backend import make_backend
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.optimizer import DeviceAdamW, WindowOptimizer
from pystronghold.runtime.precision import DynamicLossScaler, compute_dtype
from pystronghold.runtime.executor import PassExecutor
from pystronghold.runtime.schedule import build_plan
from pystronghold.runtime.step import OptimizerStep
from pystronghold.runtime.state_dict import EngineStates, install_model_hooks
from pystronghold.runtime.disk_tier import DiskTier, disk_tier_bytes, open_scratch
from pystronghold.runtime.inputs import forward_signature, move_inputs
from pystronghold.runtime.placement import plan_placement
from pystronghold.runtime.prepare import (fill_store, head_tail_bytes, materialize_resident, move_to_device,
                                          slot_bytes, split_parameters, window_slots)
from pystronghold.runtime.resident import ResidentBlocks
from pystronghold.runtime.store import BlockLayout, HostStore, default_host_budget_bytes
from pystronghold.runtime.updates import HostUpdates
from pystronghold.runtime.window import Window
from pystronghold.trace import Tracer

__all__ = ["Engine"]

log = logging.getLogger(__name__)


class Engine:
    """A model whose blocks train through a window of W device slots. Made by ``pystronghold.wrap``."""

    def __init__(self, model: torch.nn.Module, blocks: torch.nn.ModuleList, config: RuntimeConfig,
                 materialize=None) -> None:
        self.model, self.config = model, config
        total = len(blocks)
        if total == 0:
            raise ValueError("wrap: the block list is empty; pass blocks= a non-empty nn.ModuleList")
        k = config.resident_blocks
        if k > total:
            raise ValueError(f"wrap: resident_blocks={k} is more than the {total} blocks")
        n = total - k  # streamed blocks: global index k + local index
        window = window_slots(config.window, n, k)
        self.window_size, self.n_blocks, self.n_streamed = window, total, n
        self.dtype = compute_dtype(config.precision)
        self.overlap = config.overlap_mode
        par = config.parallel
        self.dp_group, self.tp_group = (par.dp_group, par.tp_group) if par is not None else (None, None)
        self.parallel = par is not None and par.world_size > 1
        if config.nvme_dir is not None:
            check_io_directory(config.nvme_dir, flag="nvme_dir=")  # also when nothing spills: fail early
        materialize = materialize_resident(model, blocks, k, materialize)
        block_named, self.head_tail_params = split_parameters(model, blocks, config.device)
        resident_params = [[p for _, p in named] for named in block_named[:k]]
        block_named, streamed = block_named[k:], list(blocks)[k:]
        layouts = [BlockLayout(named) for named in block_named]
        block_params = [[p for _, p in named] for named in block_named]
        numels = [lay.numel for lay in layouts]
        self.planned_arena_bytes = window * slot_bytes(layouts, self.dtype) if n else 0
        resident_bytes = head_tail_bytes([p for ps in resident_params for p in ps], self.dtype)
        # NOTE: every byte is planned before the first allocation, so a too-small host fails cleanly.
        self.placement = plan_placement(
            numels, self.dtype,
            budget_bytes=(default_host_budget_bytes() if config.host_memory_bytes is None
                          else int(config.host_memory_bytes)),
            # on the CPU backend the "device" (window arena, head and tail) is host memory too
            fixed_bytes=(self.planned_arena_bytes + head_tail_bytes(self.head_tail_params, self.dtype)
                         + resident_bytes if config.device == "cpu" else 0),
            nvme=config.nvme_dir is not None, cache_blocks=config.nvme_cache_blocks,
            streamed_grads=self.overlap == "backward" and config.accumulation_steps == 1,
            force_disk=config.nvme_states == "all", budget_is_limit=config.host_memory_bytes is not None)
        self.scratch = None
        if self.placement.spilled:
            self.scratch = open_scratch(config.nvme_dir, disk_tier_bytes(self.placement, numels, self.dtype),
                                        preallocate=config.nvme_preallocate)
        self.store = None
        try:
            # (an arena of one page when every block is resident: nothing streams)
            self.backend = make_backend(config.device, max(self.planned_arena_bytes, 4096), copy_threads=config.copy_threads)
            self.device = self.backend.device

            def disk_factory(placement, numels):
                engine, read_q, write_q = self.backend.file_io()
                return DiskTier(self.scratch.path, placement, numels, self.dtype, engine=engine,
                                read_queue=read_q, write_queue=write_q, arena_factory=self.backend.host_arena,
                                preallocate=config.nvme_preallocate)

            # NOTE: arenas made (pinned, zeroed) by a builder thread while the fill runs
            self.store = HostStore(layouts, self.dtype, self.backend.host_arena, placement=self.placement,
                                   disk_factory=disk_factory, background=True)
            self.fill_times = fill_store(self.store, model, streamed, block_named, block_params, materialize,
                                         threads=config.init_threads)
        except BaseException:
            if self.store is not None:
                self.store.close()
            if self.scratch is not None:
                self.scratch.close()
            raise
        # fp32 masters of head and tail from the values before any cast (as the store does for blocks)
        head_tail_masters = [p.detach().to(self.device, torch.float32) for p in self.head_tail_params]
        move_to_device(model, blocks, self.device, self.dtype)
        self.window = Window(self.backend, layouts, block_params, window, self.dtype)
        self.plans = {train: build_plan(n, window, train) for train in (True, False)} if n else {}
        self.block_forwards = block_fn.install(self, streamed)
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)
        self.trace = Tracer(enabled=config.trace, block_offset=k)  # the model's block numbers
        real_shapes = {id(p): span.shape for ps, lay in zip(block_params, layouts)
                       for p, span in zip(ps, lay.spans)}  # block parameters are placeholders now
        self.optimizer = WindowOptimizer(self, model.parameters(), config.optimizer, real_shapes)
        group_of = self.optimizer.group_of()
        self.device_optimizer = DeviceAdamW(self.head_tail_params, config.optimizer, head_tail_masters,
                                            [group_of[id(p)] for p in self.head_tail_params])
        self.resident = ResidentBlocks(list(blocks)[:k], resident_params, config.optimizer, self.device,
                                       self.dtype, recompute=config.resident_recompute, group_of=group_of)
        self.updates = HostUpdates(self.store, self.trace, bitwise_torch=config.optimizer.bitwise_torch,
                                   prefetch_depth=max(1, config.nvme_cache_blocks - 2),
                                   param_groups=[[group_of[id(p)] for p in ps] for ps in block_params])
        scaler = (DynamicLossScaler(config.initial_loss_scale, interval=config.loss_scale_interval)
                  if config.precision == "fp16" else None)
        self.stepper = OptimizerStep(model=model, config=config, optimizer=self.optimizer,
                                     device_optimizer=self.device_optimizer, resident=self.resident,
                                     updates=self.updates, block_params=self.window.params, scaler=scaler,
                                     dp_group=self.dp_group, tp_group=self.tp_group, parallel=self.parallel)
        names = {id(p): name for name, p in model.named_parameters()}
        self.states = EngineStates(self, [[names[id(p)] for p in ps] for ps in resident_params + block_params],
                                   [names[id(p)] for p in self.head_tail_params])
        install_model_hooks(self, model, streamed)  # model.state_dict() / load_state_dict() via the store
        self._forward_signature = forward_signature(model)
        self.executor = PassExecutor(config=config, window=self.window, store=self.store, backend=self.backend,
                                     updates=self.updates, stepper=self.stepper, trace=self.trace,
                                     plans=self.plans, dp_group=self.dp_group)
        if not n:  # every block resident: a backward pass is counted once it reaches their gradients
            torch.autograd.graph.register_multi_grad_hook(self.resident.params, self.executor.count_backward,
                                                          mode="any")
        kept = {True: "recomputed", False: "activations kept"}
        log.info("window runtime: %d blocks: %d resident with device AdamW (%d bytes, %s), %d streamed "
                 "(W=%d, device arena %d bytes, host store %d bytes, %s), %s, %s, overlap=%s", total, k,
                 self.resident.nbytes, kept[config.resident_recompute], n, window, self.planned_arena_bytes,
                 self.store.nbytes, kept[config.checkpointing], config.device, config.precision, self.overlap)

    # ---- user API

    def __call__(self, *args, **kwargs):
        """Run the model's own forward, with host tensors among the arguments moved to the device
        (``pystronghold.runtime.inputs.move_inputs``; a tensor on another device: ValueError)."""
        args, kwargs = move_inputs(args, kwargs, self.device, self._forward_signature)
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> "Engine":
        """Training mode (dropout on) for the model and every block, resident or not; returns self."""
        self.model.train(mode)
        return self

    def eval(self) -> "Engine":
        """Evaluation mode (dropout off) for the model and every block; returns self. Use with
        ``torch.no_grad()`` for validation or generation: that pass loads blocks through the window
        without recompute or gradient copies."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """Whether the model is in training mode (``train()``/``eval()``)."""
        return self.model.training

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale in fp16)."""
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        if self.executor.in_pass():
            raise RuntimeError("backward did not reach the first block: the loss does not depend on "
                               "every block, or only part of the graph was back-propagated")

    def step(self) -> None:
        """One optimizer step (also ``engine.optimizer.step()``, which LR schedulers track)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Forget the gradients (head/tail ``.grad`` set to None; block gradients reset)."""
        self.optimizer.zero_grad()

    def synchronize(self) -> None:
        """Wait for every copy and host update in flight (forward-overlap updates included)."""
        self.executor.synchronize()

    def in_flight(self) -> int:
        """Copies and host jobs not finished yet."""
        return self.executor.in_flight()

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 value of every parameter by its model name (host store for blocks); synchronizes first."""
        return self.states.master_parameters()

    def in_pass(self) -> bool:
        """True between a forward's first block and the end of its backward (or of an inference pass)."""
        return self.executor.in_pass()

    def stats(self) -> dict:
        """Counters for invariants and benchmarks (bytes, counts)."""
        return dict(window=self.window_size, blocks=self.n_blocks, resident_blocks=self.resident.count,
                    resident_bytes=self.resident.nbytes, streamed_blocks=self.n_streamed,
                    peak_resident=self.window.peak_resident,
                    planned_arena_bytes=self.planned_arena_bytes, arena_used_bytes=self.backend.arena_used_bytes,
                    store_bytes=self.store.nbytes, steps=self.steps, skipped_steps=self.skipped_steps,
                    loss_scale=self.scaler.scale if self.scaler else None, grad_norm=self.grad_norm,
                    disk=self.store.disk_stats())

    def close(self) -> None:
        """Finish everything in flight and stop the worker threads (re-raises a host job's error)."""
        try:
            self.synchronize()
        finally:
            self.updates.close()
            self.store.close()
            self.backend.close()
            if self.scratch is not None:
                self.scratch.close()

    def span(self, kind: str, block: int | None, *, host: bool = False):
        """Trace ``kind``: timed by the backend's clock (CUDA: events on the compute stream), or by
        the host's when ``host`` (work the host itself waits for)."""
        return self.executor.span(kind, block, host=host)

    # ---- the schedule (runtime/executor.py), driven by block_fn.BlockFunction

    def enter(self, block: int, phase: str, train: bool) -> None:
        """Before ``block`` computes in ``phase``: its load is issued and waited for; params bound."""
        self.executor.enter(block, phase, train)

    def leave(self, block: int, phase: str, param_grads=None) -> None:
        """After ``block`` computed: in backward hand its gradient out; then run the plan's actions."""
        self.executor.leave(block, phase, param_grads)

    @property
    def micro_batches(self) -> int:
        """Backward passes since the last step."""
        return self.executor.micro_batches

    # ---- optimizer step (runtime/step.py), between passes

    @property
    def scaler(self):
        """fp16 loss scaler (``DynamicLossScaler``), or None in fp32/bf16."""
        return self.stepper.scaler

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted); set when a checkpoint is loaded."""
        return self.stepper.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.stepper.steps = value

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for an overflow; set when a checkpoint is loaded."""
        return self.stepper.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.stepper.skipped_steps = value

    @property
    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (computed for clipping or fp16 only)."""
        return self.stepper.grad_norm

    def _step(self) -> None:
        self.executor.finish_accumulation()
        self.stepper.run()
        self.executor.end_accumulation()

    def _zero_grad(self) -> None:
        self.stepper.zero_grad()
        self.executor.forget_grads()
