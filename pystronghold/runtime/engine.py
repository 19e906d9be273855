"""The engine: runs the schedule from inside each block's autograd Function, and the optimizer step.

Per pass (forward, then backward when training) the engine walks the plan of ``schedule.py``:
``enter(block)`` before a block computes (issue what is pending, wait for its load, bind its
parameters to the slot), ``leave(block)`` after (in backward: gradients into the slot's flat
buffer, one copy-out, a host job; then the plan's releases and prefetch loads). A load of block i
is issued only after block i's last host update has finished, and into a slot only after that
slot's previous copy-out (and compute) finished. See docs/DESIGN.md "Window runtime".
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from pystronghold.io.scratch import check_io_directory
from pystronghold.parallel.data import any_rank, average_, average_grads_, global_grad_norm, is_tp_shard
from pystronghold.runtime import block_fn
from pystronghold.runtime.backend import make_backend
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.optimizer import DeviceAdamW, WindowOptimizer
from pystronghold.runtime.precision import DynamicLossScaler, compute_dtype
from pystronghold.runtime.schedule import Load, Release, build_plan
from pystronghold.runtime.state_dict import EngineStates, install_model_hooks
from pystronghold.runtime.disk_tier import DiskTier, disk_tier_bytes, open_scratch
from pystronghold.runtime.inputs import forward_signature, move_inputs
from pystronghold.runtime.placement import plan_placement
from pystronghold.runtime.prepare import (fill_store, head_tail_bytes, materialize_resident, move_to_device,
                                          slot_bytes, split_parameters, window_slots)
from pystronghold.runtime.grad_norms import BlockGradNorms
from pystronghold.runtime.resident import ResidentBlocks
from pystronghold.runtime.store import BlockLayout, HostStore, default_host_budget_bytes
from pystronghold.runtime.timing import copy_marks
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
        # ---- norms-planner: per-parameter gradient norms where the gradients are (runtime/grad_norms.py)
        self.grad_norms = BlockGradNorms(self.updates, on_device=self.device.type == "cuda")
        # ---- end norms-planner
        self.scaler = (DynamicLossScaler(config.initial_loss_scale, interval=config.loss_scale_interval)
                       if config.precision == "fp16" else None)
        names = {id(p): name for name, p in model.named_parameters()}
        self.states = EngineStates(self, [[names[id(p)] for p in ps] for ps in resident_params + block_params],
                                   [names[id(p)] for p in self.head_tail_params])
        install_model_hooks(self, model, streamed)  # model.state_dict() / load_state_dict() via the store
        self._forward_signature = forward_signature(model)
        # pass state
        self._plan = None  # the plan of the pass in progress
        self._pos = 0  # index of the next use in the plan
        self._loads: dict[int, object] = {}  # block -> handle of its last load
        self._load_leases: dict[int, object] = {}  # block -> its load's disk lease (reads to check)
        self._pending: list[int] = []  # blocks whose load waits for their host update
        self._grad_out: dict[int, object] = {}  # block -> handle of its gradient copy-out
        self._grad_valid = [False] * n  # host grad holds earlier micro-batches' sum
        self._copies: list[tuple[str, int, object]] = []  # for the trace
        self.micro_batches = 0  # backward passes since the last step
        self.steps = 0  # optimizer steps taken (skipped fp16 steps not counted)
        self.skipped_steps = 0
        self.grad_norm: float | None = None  # the last step's global gradient norm (clipping/fp16)
        self._test_skip_waits: set[str] = set()  # test hook: {"load"} removes the compute-waits-for-load
        if not n:  # every block resident: a backward pass is counted once it reaches their gradients
            torch.autograd.graph.register_multi_grad_hook(self.resident.params, self._count_backward, mode="any")
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
        if self._plan is not None:
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
        self.updates.drain()
        for _, _, h in self._copies:
            h.wait()
        self.backend.synchronize()
        self.store.synchronize()
        self._flush_copies(calibrate=True)

    def in_flight(self) -> int:
        """Copies and host jobs not finished yet."""
        return sum(not h.done() for _, _, h in self._copies) + self.updates.in_flight()

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 value of every parameter by its model name (host store for blocks); synchronizes first."""
        return self.states.master_parameters()

    def in_pass(self) -> bool:
        """True between a forward's first block and the end of its backward (or of an inference pass)."""
        return self._plan is not None

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
        if not self.trace.enabled:
            return contextlib.nullcontext()
        return self.trace.span(kind, block, clock=None if host else self.backend.clock)

    # ---- the schedule, driven by block_fn.BlockFunction

    def enter(self, block: int, phase: str, train: bool) -> None:
        """Before ``block`` computes in ``phase``: its load is issued and waited for; params bound."""
        if phase == "fwd" and block == 0:
            self._begin_pass(train)
        plan = self._plan
        use = plan.uses[self._pos] if plan is not None and self._pos < len(plan.uses) else None
        if use is None or (use.phase, use.block) != (phase, block):
            raise RuntimeError(
                f"block {block} ran its {phase} out of the expected order (expected {use}); the window "
                "runtime needs each block called once per forward, in order 0..N-1")
        self._pump()
        if block in self._pending:
            with self.span("wait", block, host=True):
                self.updates.updates[block].result()
            self._pending.remove(block)
            self._issue(block)
        handle = self._loads.pop(block, None)
        lease = self._load_leases.pop(block, None)
        if lease is not None:
            lease.wait()  # its disk reads (the load depends on them; this names the file on failure)
        if handle is not None and "load" not in self._test_skip_waits:
            if handle.done():
                self.backend.compute_wait(handle)
            else:
                with self.span("wait", block):
                    self.backend.compute_wait(handle)
        if phase == "bwd" and self._grad_valid[block]:
            # accumulation: the earlier micro-batches' sum comes back so this one adds to it
            slot = self.window.resident[block]
            n = self.store.layouts[block].numel
            lease = self.store.acquire(block, ["grad"])
            lease.wait()
            # NOTE: after the previous micro-batch's copy-out of this block (another queue/stream)
            h = self.backend.h2d(slot.grads[:n], lease.tensors["grad"], after=[self._grad_out.get(block)])
            self.store.release(lease, after=[h])
            self._copies.append(("h2d", block, h))
            with self.span("wait", block):
                self.backend.compute_wait(h)
        self.window.bind(block)

    def leave(self, block: int, phase: str, param_grads=None) -> None:
        """After ``block`` computed: in backward hand its gradient out; then run the plan's actions."""
        if phase == "bwd":
            self._grad_to_host(block, param_grads)
        for action in self._plan.after[self._pos]:
            if isinstance(action, Release):
                self._release(action)
            else:
                self._load(action)
        self._pos += 1
        if self._pos == len(self._plan.uses):
            if len(self._plan.uses) > self.n_streamed:
                self.micro_batches += 1
            self._plan = None
            self._flush_copies()  # finished copies go to the trace and are dropped

    def _count_backward(self, grad) -> None:
        self.micro_batches += 1

    def _begin_pass(self, train: bool) -> None:
        if self._plan is not None:
            log.warning("a new forward started before the previous pass finished (no backward?); "
                        "abandoning it")
            self._abandon_pass()
        if train and self.micro_batches >= self.config.accumulation_steps:
            raise RuntimeError(f"a training forward after {self.micro_batches} backward passes without "
                               f"step() (accumulation_steps={self.config.accumulation_steps})")
        self._plan, self._pos = self.plans[train], 0
        for action in self._plan.prologue:
            self._load(action)

    def _abandon_pass(self) -> None:
        for h in self._loads.values():
            h.wait()
        self._loads.clear()
        self._load_leases.clear()
        self._pending.clear()
        for block in list(self.window.resident):
            self.window.vacate(block)
        self._plan = None

    def _load(self, action: Load) -> None:
        self.window.occupy(action.block, action.slot)
        if self.updates.pending(action.block) is not None:
            self._pending.append(action.block)  # issued by _pump once the host update is done
        else:
            self._issue(action.block)

    def _issue(self, block: int) -> None:
        slot = self.window.resident[block]
        n = self.store.layouts[block].numel
        lease = self.store.acquire(block, [self.store.upload_state])
        handle = self.backend.h2d(slot.params[:n], lease.tensors[self.store.upload_state],
                                  after=[*slot.busy, *lease.read_handles()])
        self.store.release(lease, after=[handle])  # the cache slot stays until the copy is done
        if lease.slot is not None:
            self._load_leases[block] = lease
        slot.busy = []
        self._loads[block] = handle
        self._copies.append(("h2d", block, handle))

    def _pump(self) -> None:
        for block in list(self._pending):
            if self.updates.pending(block) is None:
                self._pending.remove(block)
                self._issue(block)

    def _release(self, action: Release) -> None:
        slot = self.window.vacate(action.block)
        marker = self.backend.compute_marker()
        if marker is not None:
            slot.busy.append(marker)
        if self.config.strict:
            for h in slot.busy:
                h.wait()
            self.backend.poison(slot.params)
            self.backend.poison(slot.grads)

    def _grad_to_host(self, block: int, param_grads) -> None:
        slot = self.window.resident[block]
        accumulate = self._grad_valid[block]
        for view, g in zip(self.window.grad_views(block), param_grads):
            if g is not None:
                view.add_(g) if accumulate else view.copy_(g)
            elif not accumulate:
                view.zero_()
        layout = self.store.layouts[block]
        if not accumulate:
            layout.zero_gaps(slot.grads)
        last = self.micro_batches + 1 >= self.config.accumulation_steps
        if last:
            # data parallelism: the block's whole gradient (all micro-batches) averaged over the DP
            # ranks in one all_reduce, where it is now: in the device slot, before the copy-out
            average_(slot.grads[:layout.numel], self.dp_group)
        streamed = last and self.overlap == "backward"
        # NOTE: a streamed update stages its optimizer states now, so their disk reads overlap the copy-out
        states = ["grad", *self.updates.update_states] if streamed else ["grad"]
        if last and self.config.needs_global_grad:  # norms-planner: the device path's norms, pre copy-out
            self.grad_norms.before_copy_out(block, self.window.grad_views(block), self._unscale())
        lease = self.store.acquire(block, states, fresh=["grad"])
        handle = self.backend.d2h(lease.tensors["grad"], slot.grads[:layout.numel],
                                  after=[self.backend.compute_marker()])
        slot.busy.append(handle)
        self._grad_out[block] = handle
        self._copies.append(("d2h", block, handle))
        self._grad_valid[block] = True
        if streamed:
            self.updates.submit_update(block, handle, step=self.steps + 1, hyper=self.optimizer.hyper(),
                                       grad_scale=1.0, lease=lease)
            if block > 0:
                self.store.prefetch(block - 1, self.updates.update_states)
            return
        self.store.release(lease, dirty=["grad"], after=[handle])
        if last and self.config.needs_global_grad:
            self.grad_norms.after_copy_out(block, handle, self._unscale())  # norms-planner: the host path

    # ---- optimizer step

    def _unscale(self) -> float:
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def _step(self) -> None:
        if self._plan is not None:
            raise RuntimeError("step() during a forward/backward pass")
        if self.micro_batches != self.config.accumulation_steps:
            raise RuntimeError(f"step() after {self.micro_batches} backward passes; accumulation_steps="
                               f"{self.config.accumulation_steps} must be completed first")
        for h in self._grad_out.values():
            h.wait()
        self._grad_out.clear()
        average_grads_(self.device_optimizer.params + self.resident.params, self.dp_group)  # one bucket
        hyper, step = self.optimizer.hyper(), self.steps + 1
        if self.overlap == "backward":
            self.updates.drain()
            self.device_optimizer.step(hyper, 1.0)
            self.resident.step(hyper, 1.0, self.steps)
        else:
            scale = self._unscale()
            coef = 1.0
            if self.config.needs_global_grad:
                total = self.grad_norm = self._global_grad_norm(scale)
                if self.scaler is not None:
                    overflow = not math.isfinite(total)
                    if self.parallel:  # every rank skips together, or none does
                        overflow = any_rank(overflow)
                    self.scaler.update(overflow)
                    if overflow:
                        log.info("fp16 overflow: step skipped for every block; loss scale now %g",
                                 self.scaler.scale)
                        self.skipped_steps += 1
                        self._end_step()
                        return
                if self.config.clip_grad_norm is not None:
                    # NOTE: the fp32 arithmetic of torch.nn.utils.clip_grad_norm_, for bit-exactness
                    coef = float(torch.clamp(self.config.clip_grad_norm / (torch.tensor(total) + 1e-6),
                                             max=1.0))
            for block in range(self.n_streamed):  # 0, 1, 2, ...: the order the next forward loads them
                self.updates.submit_update(block, None, step=step, hyper=hyper, grad_scale=scale * coef)
            self.device_optimizer.step(hyper, scale * coef)
            self.resident.step(hyper, scale * coef, self.steps)
            if self.overlap == "none":
                self.updates.drain()
        self.steps = step
        self._end_step()

    def _global_grad_norm(self, grad_scale: float) -> float:
        """L2 norm over every gradient (head, blocks, tail), combined in model.parameters() order;
        tensor-parallel shards summed over the TP group (pystronghold.parallel.data)."""
        norms = {**self.device_optimizer.grad_norms(grad_scale), **self.resident.grad_norms(grad_scale)}
        for block, per_param in self.grad_norms.take().items():  # norms-planner
            for p, n in zip(self.window.params[block], per_param):
                norms[id(p)] = n
        params = [p for p in self.model.parameters() if id(p) in norms]
        return global_grad_norm([norms[id(p)] for p in params], [is_tp_shard(p) for p in params],
                                self.tp_group)

    def _end_step(self) -> None:
        self.micro_batches = 0
        self._grad_valid = [False] * self.n_streamed
        self._flush_copies(calibrate=True)

    def _zero_grad(self) -> None:
        self.device_optimizer.zero_grad()
        self.resident.zero_grad()
        if self._plan is None and self.micro_batches:
            self.micro_batches = 0
            self._grad_valid = [False] * self.n_streamed

    def _flush_copies(self, calibrate: bool = False) -> None:
        """Finished copies go to the trace and are dropped; with ``calibrate`` (step end, sync) the
        trace's device-timed spans are placed on the host clock (runtime/timing.py)."""
        self._copies.extend(self.store.take_events())
        keep = []
        for kind, block, h in self._copies:
            if h.done():
                if self.trace.enabled:
                    start, end = copy_marks(h)
                    self.trace.defer(kind, block, start, end, h.nbytes)
            else:
                keep.append((kind, block, h))
        self._copies = keep
        if calibrate and self.trace.pending():
            self.trace.resolve(self.backend.clock.calibrate)
