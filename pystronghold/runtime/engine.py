"""The engine: what ``pystronghold.wrap`` returns, composed of three parts, one per job.

Building (``build.py``), the pass executor (``streaming/executor.py``: loads, releases, copy-outs, host jobs
around each block) and the step (``optimizer/step.py``: norms, fp16 overflow, clipping, updates). ``Engine``
holds none of that logic: it gives the user API (call, train/eval, backward, step, zero_grad,
synchronize, stats, memory_report, state_dict, close, states); the parts are private. See
docs/DESIGN.md "Window runtime".
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pystronghold.runtime.blocks import block_fn
from pystronghold.runtime.streaming import relay
from pystronghold.runtime.build import build_optimizers, build_parts
from pystronghold.runtime.config import RuntimeConfig, offload_in_effect
from pystronghold.runtime.streaming.executor import PassExecutor
from pystronghold.runtime.tracing.host_time import HostSpans
from pystronghold.runtime.streaming.schedule import Plan
from pystronghold.runtime.blocks.inputs import forward_signature, move_inputs
from pystronghold.runtime.memory_report import EngineMemory, measure_memory
from pystronghold.optim.window_optimizer import WindowOptimizer
from pystronghold.runtime.prepare import device_total_bytes
from pystronghold.runtime.states.optimizer_state import (engine_state_dict, load_engine_state_dict,
                                                  load_optimizer_state_dict, optimizer_state_dict)
from pystronghold.runtime.states.state_dict import EngineStates, install_model_hooks
from pystronghold.runtime.optimizer.step import OptimizerStep

__all__ = ["Engine", "engine_parts_for_tests"]

log = logging.getLogger(__name__)


def _stepper_counter(name: str, doc: str) -> property:
    """A read/write property of ``Engine`` for the counter ``name`` of its ``OptimizerStep``."""
    return property(lambda engine: getattr(engine._stepper, name),
                    lambda engine, value: setattr(engine._stepper, name, value), doc=doc)


class Engine:
    """A model whose blocks train through a window of W device slots. Made by ``pystronghold.wrap``."""

    def __init__(self, model: torch.nn.Module, blocks: torch.nn.ModuleList, config: RuntimeConfig,
                 materialize=None) -> None:
        if config.offload_block_inputs == "auto":  # the engine's config says what is in effect
            config = dataclasses.replace(config, offload_block_inputs=offload_in_effect(
                config, device_total_bytes(config.device)))
        self.model, self.config = model, config
        parts = build_parts(model, blocks, config, materialize)
        # the parts others read by their public names; the store, window, plans, updates, executor
        # and stepper are private (runtime modules are handed the ones they use)
        self.n_blocks, self.n_streamed = parts.n_blocks, len(parts.block_params)
        self.window_size = parts.window_size
        self.dtype, self.overlap, self.placement = parts.dtype, parts.modes.overlap, parts.placement
        self.planned_arena_bytes, self.fill_times = parts.planned_arena_bytes, parts.fill_times
        self.backend, self.device, self.scratch = parts.backend, parts.backend.device, parts.scratch
        self._store, self._window, self._plans, self.trace = parts.store, parts.window, parts.plans, parts.trace
        self.head_tail_params = parts.head_tail_params
        self.head_tail_on_host = parts.head_tail_on_host
        """Head and tail train from host memory (``RuntimeConfig.head_tail_on_host``, "auto" resolved)."""
        self.host_spans = HostSpans(self.trace)  # model / engine / step spans (runtime/tracing/host_time.py)
        self.dp_group, self.tp_group, self.parallel = parts.dp_group, parts.tp_group, parts.parallel
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)
        # which parameters train is fixed here: the layouts, optimizer states and param groups follow it
        self._requires_grad = [(name, p, p.requires_grad) for name, p in model.named_parameters()]
        self._param_counts = {flag: sum(parts.real_shapes.get(id(p), p.shape).numel()
                                        for _, p, trains in self._requires_grad if trains == flag)
                              for flag in (True, False)}  # elements (block parameters are placeholders now)
        # NOTE: the optimizer holds the engine itself (``WindowSteps``), so its methods are looked up
        # at each call (tests wrap run_step)
        self.optimizer = WindowOptimizer([p for p in model.parameters() if p.requires_grad], config.optimizer,
                                         parts.real_shapes, steps=self)
        updaters = build_optimizers(parts, config, self.optimizer.group_of())
        self.device_optimizer, self.resident, self._updates = (updaters.device_optimizer, updaters.resident,
                                                               updaters.updates)
        self.grad_norms = updaters.grad_norms
        """Where the streamed blocks' gradient norms are taken (``grad_norms.BlockGradNorms``)."""
        self._stepper = OptimizerStep(model=model, config=config, overlap=self.overlap, optimizer=self.optimizer,
                                      device_optimizer=self.device_optimizer, resident=self.resident,
                                      updates=self._updates, grad_norms=self.grad_norms, window=self._window,
                                      scaler=updaters.scaler, dp_group=self.dp_group, tp_group=self.tp_group,
                                      pp_group=parts.pp_group, parallel=self.parallel)
        self._executor = PassExecutor(config=config, overlap=self.overlap, window=self._window, store=self._store,
                                      backend=self.backend, updates=self._updates, grad_norms=self.grad_norms,
                                      stepper=self._stepper, trace=self.trace, plans=self._plans, model=model,
                                      dp_group=self.dp_group, before_training_pass=self.check_requires_grad)
        self.block_forwards = block_fn.install(parts.streamed_blocks, calls=self, executor=self._executor,
                                               window=self._window, checkpointing=config.checkpointing,
                                               strict=config.strict, device=self.device, anchor=self.anchor)
        if not self.n_streamed:
            # all blocks resident: a backward pass counts once it reaches their gradients (the head's
            # and tail's when every block is frozen)
            torch.autograd.graph.register_multi_grad_hook(self.resident.params or self.device_optimizer.params,
                                                          self._executor.count_backward, mode="any")
        self.states = EngineStates(parts.block_names, parts.head_tail_names, store=self._store, window=self._window,
                                   resident=self.resident, device_optimizer=self.device_optimizer,
                                   head_tail_params=self.head_tail_params, executor=self._executor)
        # model.state_dict() etc. via the store, the masters in their dtype before wrap
        install_model_hooks(self.states, model, parts.streamed_blocks, parts.saved_dtypes, store=self._store,
                            window=self._window, resident=self.resident, device_optimizer=self.device_optimizer,
                            head_tail_params=self.head_tail_params)
        self._forward_signature = forward_signature(model)
        kept = {True: "recomputed", False: "activations kept"}
        log.info("window runtime: %d blocks: %d resident with device AdamW (%d bytes, %s), %d streamed "
                 "(W=%d, device arena %d bytes, host store %d bytes, %s), %s, %s, overlap=%s", self.n_blocks,
                 self.resident.count, self.resident.nbytes, kept[config.resident_recompute], self.n_streamed,
                 self.window_size, self.planned_arena_bytes, self._store.nbytes, kept[config.checkpointing],
                 config.device, config.precision, self.overlap)
        if self.head_tail_on_host:
            log.info("head and tail: fp32 masters and AdamW moments in host memory (%d bytes%s), updated by the "
                     "host Adam at each step", self.device_optimizer.host_bytes,
                     ", pinned" if self.device_optimizer.pinned else "")
        if config.offload_block_inputs is not False:
            if not self.n_streamed:
                log.warning("offload_block_inputs: every block is resident (no recompute through the window): "
                            "no block input is offloaded")
            else:
                log.info("input offload: %s saved block inputs go to host memory",
                         "all" if config.offload_block_inputs is True else
                         f"beyond {config.offload_block_inputs} device bytes per pass,")
        if parts.modes.schedule == "relay":
            log.info("relay schedule (engine.accumulate): saved block inputs on the device %s",
                     "without limit" if config.relay_activation_bytes is None else
                     f"up to {config.relay_activation_bytes} bytes, staged through host memory beyond")

    # ---- user API

    def __call__(self, *args, **kwargs):
        """Run the model's own forward, with host tensors among the arguments moved to the device
        (``pystronghold.runtime.blocks.inputs.move_inputs``; a tensor on another device: ValueError)."""
        args, kwargs = move_inputs(args, kwargs, self.device, self._forward_signature)
        return self.call(self.model, *args, **kwargs)

    def call(self, fn, *args, **kwargs):
        """Run ``fn`` (the model's own code: a submodule of the wrapped model, such as a Hugging Face
        model's base without its LM head, or a loss over its outputs) as the model's time in the
        trace's host spans. Arguments must already be on the device."""
        if not self.trace.enabled:
            return fn(*args, **kwargs)
        self.host_spans.model_resumes()
        try:
            return fn(*args, **kwargs)
        finally:
            self.host_spans.model_pauses()

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

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (unchanged in fp32/bf16): what backward propagates. In
        fp16, ``step()`` refuses a step with a backward pass that did not start from it."""
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (scaled by the loss scale in fp16)."""
        if self.trace.enabled:
            self.host_spans.model_resumes()
        try:
            self.scale_loss(loss).backward()
        finally:
            if self.trace.enabled:
                self.host_spans.model_pauses()
        if self._executor.in_pass():
            raise RuntimeError("backward did not reach the first block: the loss does not depend on "
                               "every block, or only part of the graph was back-propagated")

    def accumulate(self, micro_batches, loss_fn, *, mean: bool = True) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``micro_batches`` (a sequence of m items,
        each passed to ``loss_fn(item) -> one-element loss tensor``, which calls this engine);
        back-propagates ``loss / m`` of each (``mean=False``: ``loss``). Returns the m losses,
        detached, shape (m,). Call ``step()`` after it as usual.

        With ``schedule="relay"`` the m micro-batches run layer-major (each streamed block is loaded
        once in forward and once in backward, its gradient leaves the device once; runtime/streaming/relay.py);
        otherwise one after the other, as a loop of ``engine(...)``/``backward`` would."""
        return relay.accumulate(self, self._executor, micro_batches, loss_fn, mean=mean)

    def step(self) -> None:
        """One optimizer step (also ``engine.optimizer.step()``, which LR schedulers track)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Forget the gradients (head/tail ``.grad`` set to None; block gradients reset)."""
        self.optimizer.zero_grad()

    def synchronize(self, *, updates: bool = True) -> None:
        """Wait for every copy and host update in flight (forward-overlap updates included).

        ``updates=False``: wait for the device's work and the copies only (what a log line needs:
        the losses, the time, the trace's device spans), leaving the host updates of a
        forward-overlap step (clipping, fp16) to run on behind the next forward, whose loads wait
        for each block's own. Drain (the default) before reading the store: a checkpoint, an
        export, the end of a run."""
        self._executor.synchronize(updates)

    def in_flight(self) -> int:
        """Copies and host jobs not finished yet."""
        return self._executor.in_flight()

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 value of every parameter by its model name (host store for blocks); synchronizes first."""
        return self.states.master_parameters()

    def state_dict(self) -> dict:
        """What the engine itself holds: step counts (the run's, the fp16 skips, each block's), the fp16
        loss scale and the layer-drop draws (``optimizer_state.engine_state_dict``). With
        ``model.state_dict()`` and ``engine.optimizer.state_dict()`` it is a whole checkpoint."""
        return engine_state_dict(self._stepper, self._executor.layer_drop, self.n_blocks)

    def load_state_dict(self, state: dict) -> None:
        """Load ``state_dict()``'s values (between steps; ValueError for a state that does not fit)."""
        load_engine_state_dict(self._stepper, self._executor, self.n_blocks, state)

    def use_step_plan(self, plan: Plan, train: bool = True) -> None:
        """Train with ``plan`` (``schedule.plan_uses``) covering a whole optimizer step instead of
        one forward and backward: a pipeline stage runs its micro-batches' passes interleaved in its
        schedule's order (``pystronghold.pipelining``); ``train=False``: the plan of a whole
        evaluation step's forwards (an interleaved stage's model chunks in turn). Each use is
        checked as it happens, so a schedule that runs in another order raises instead of computing
        with wrong blocks."""
        self._executor.use_step_plan(plan, train)

    def in_pass(self) -> bool:
        """True between a forward's first block and the end of its backward (or of an inference pass)."""
        return self._executor.in_pass()

    def stats(self) -> dict:
        """Counters for invariants and benchmarks (bytes, counts): ``trainable_params`` and
        ``frozen_params`` count the model's parameter elements (blocks, head and tail);
        ``store_bytes`` is the host store's allocation (the file tier's cache included),
        ``store_frozen_bytes`` the part of it that holds frozen block parameters (their padded
        elements in the compute dtype: ``layout.frozen_bytes_per_param`` each). The byte counts
        are ``memory_report()``'s; ``undo_bytes`` the host copy speculative clipping holds
        (``clip_mode="speculative"``; ``updates.undo_bytes``). ``saved_inputs``: the last training
        pass's saved block inputs under ``offload_block_inputs`` or the relay's staging
        (``device_bytes`` kept, ``staged_bytes`` copied to host memory, ``disk_bytes`` of those on to
        the NVMe tier), None before such a pass."""
        memory = self.memory_report()
        executor = self._executor
        return dict(window=self.window_size, blocks=self.n_blocks, resident_blocks=self.resident.count,
                    resident_bytes=memory.device_resident_blocks_bytes, streamed_blocks=self.n_streamed,
                    peak_resident=self._window.peak_resident,
                    planned_arena_bytes=memory.device_window_bytes, arena_used_bytes=memory.device_arena_used_bytes,
                    store_bytes=memory.host_store_bytes, store_frozen_bytes=memory.host_frozen_bytes,
                    trainable_params=self._param_counts[True], frozen_params=self._param_counts[False],
                    steps=self.steps, skipped_steps=self.skipped_steps,
                    loss_scale=self.scaler.scale if self.scaler else None, grad_norm=self.grad_norm,
                    disk=memory.disk, undo_bytes=self._updates.held_undo_bytes(),
                    saved_inputs=executor.relay_activations if self.config.schedule_mode == "relay"
                    else executor.input_offload)

    def memory_report(self) -> EngineMemory:
        """Where the engine's bytes are now (``memory_report.EngineMemory``: the device window,
        resident blocks and head/tail, the host store by tier, the file tier's counters)."""
        return measure_memory(store=self._store, resident=self.resident, backend=self.backend,
                              head_tail_params=self.head_tail_params, dtype=self.dtype,
                              window_slots=self.window_size, planned_arena_bytes=self.planned_arena_bytes,
                              host_head_tail_bytes=self.device_optimizer.host_bytes if self.head_tail_on_host else 0)

    def close(self) -> None:
        """Finish everything in flight and stop the worker threads (re-raises a host job's error)."""
        try:
            self.synchronize()
        finally:
            self._updates.close()
            self._store.close()
            self.backend.close()
            if self.scratch is not None:
                self.scratch.close()
            if self._executor.input_spill is not None:
                self._executor.input_spill.close()

    def span(self, kind: str, block: int | None, *, host: bool = False):
        """Trace ``kind``: timed by the backend's clock (CUDA: events on the compute stream), or by
        the host's when ``host`` (work the host itself waits for)."""
        return self._executor.span(kind, block, host=host)

    # ---- the schedule (runtime/streaming/executor.py), driven by block_fn.BlockFunction

    def enter(self, block: int, phase: str, train: bool) -> None:
        """Before ``block`` computes in ``phase``: its load is issued and waited for; params bound."""
        if not self.trace.enabled:
            return self._executor.enter(block, phase, train)
        start = self.host_spans.model_pauses()
        self._executor.enter(block, phase, train)
        self.host_spans.engine(block, start)

    def leave(self, block: int, phase: str, param_grads=None) -> None:
        """After ``block`` computed: in backward hand its gradient out; then run the plan's actions."""
        if not self.trace.enabled:
            return self._executor.leave(block, phase, param_grads)
        start = time.monotonic()
        self._executor.leave(block, phase, param_grads)
        self.host_spans.model_resumes(self.host_spans.engine(block, start))

    @property
    def micro_batches(self) -> int:
        """Backward passes since the last step."""
        return self._executor.micro_batches

    @property
    def layer_drop(self):
        """Which streamed blocks run this step (``layer_drop.LayerDrop``; its ``state_dict`` is what
        checkpoints keep of it)."""
        return self._executor.layer_drop

    # ---- optimizer step (runtime/optimizer/step.py), between passes

    @property
    def scaler(self):
        """fp16 loss scaler (``DynamicLossScaler``), or None in fp32/bf16."""
        return self._stepper.scaler

    # read by states/optimizer_state.py, checkpoints and tests, set when a checkpoint is loaded
    steps = _stepper_counter("steps", "Optimizer steps taken (skipped fp16 steps not counted).")
    skipped_steps = _stepper_counter("skipped_steps", "fp16 steps skipped for an overflow (a run that "
                                     "cannot go on raises ``DivergenceError`` instead).")
    block_steps = _stepper_counter("block_steps", "AdamW steps of each streamed block (layer drop: fewer "
                                   "for a block skipped in some steps); set after ``steps``.")

    @property
    def grad_norm(self) -> float | None:
        """The last step's global gradient norm (computed for clipping or fp16 only)."""
        return self._stepper.grad_norm

    def run_step(self) -> None:
        """The optimizer step itself, as ``engine.optimizer.step()`` runs it (call ``step()``): every
        gradient copy-out waited for, the step (``OptimizerStep.run``), a new accumulation begun."""
        with self.trace.span("step"):
            self.check_requires_grad()
            self._executor.finish_accumulation()
            self._stepper.check_loss_scaled(self._executor.micro_batches)
            self._stepper.run(self._executor.active_blocks())
            self._executor.end_accumulation()

    def check_requires_grad(self) -> None:
        """ValueError when a parameter's ``requires_grad`` differs from what it was at ``wrap``
        (checked before each training pass and each step): the store's layout, the optimizer
        states and the param groups were made for the parameters that trained then."""
        for name, p, trains in self._requires_grad:
            if p.requires_grad != trains:
                raise ValueError(f"{name!r} has requires_grad={p.requires_grad}, but it was {trains} when the "
                                 "model was wrapped; which parameters train is fixed at wrap: set requires_grad "
                                 "before pystronghold.wrap (wrap a new model to change it)")

    def forget_grads(self) -> None:
        """Gradients dropped, as ``engine.optimizer.zero_grad()`` does it (call ``zero_grad()``)."""
        self._stepper.zero_grad()
        self._executor.forget_grads()

    def optimizer_state_dict(self) -> dict:
        """The optimizer state, as ``engine.optimizer.state_dict()`` returns it (call that)."""
        return optimizer_state_dict(self.optimizer.param_groups, self.states, self._stepper)

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load an optimizer state, as ``engine.optimizer.load_state_dict()`` does it (call that)."""
        load_optimizer_state_dict(self.optimizer.param_groups, self.states, self._stepper, state_dict)


def engine_parts_for_tests(engine: Engine) -> dict:
    """For tests only: the engine's private parts by name (``store``, ``window``, ``plans``,
    ``updates``, ``executor``, ``stepper``), to inject a fault or a slow copy, or to read a layout
    the public interface does not give. Library code uses the ``Engine``'s methods."""
    return dict(store=engine._store, window=engine._window, plans=engine._plans, updates=engine._updates,
                executor=engine._executor, stepper=engine._stepper)
