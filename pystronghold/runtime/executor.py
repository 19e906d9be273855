"""The pass executor: runs the window schedule from inside each block's autograd Function.

Per pass it walks the plan of ``schedule.py``: ``enter(block)`` issues pending loads, waits for
the block's and binds its parameters to the slot; ``leave(block)`` (in backward) gathers gradients
into the slot, copies them out, submits the host update, then releases and prefetches. A load
waits for the block's last host update and for the slot's previous copy-out. Relay passes
(``relay.py``) and layer-drop steps (``layer_drop.py``) use cached variant plans. See
docs/DESIGN.md "The window and the copy engine".
"""

from __future__ import annotations

import contextlib
import logging

from pystronghold.parallel.data import average_
from pystronghold.runtime.streaming.layer_drop import LayerDrop
from pystronghold.runtime.streaming.input_spill import InputSpill
from pystronghold.runtime.streaming.saved_inputs import SavedInputs
from pystronghold.runtime.streaming.schedule import Load, Release, Use, build_plan
from pystronghold.runtime.tracing.timing import copy_marks

__all__ = ["PassExecutor"]

log = logging.getLogger(__name__)


class PassExecutor:
    """The engine's pass executor (private to it): the state of the pass in progress and of the gradients accumulated
    since the last step. ``block_fn.BlockFunction`` calls ``enter``/``leave`` (through the engine).

    ``plans``: the schedule of a training and of an inference pass (``schedule.build_plan``) by
    ``train``; ``stepper``: the ``OptimizerStep`` whose next step a streamed update belongs to;
    ``model``: the wrapped model (layer drop applies in its training mode only);
    ``before_training_pass``: called before a training pass begins (may raise to refuse it).
    """

    def __init__(self, *, config, overlap: str, window, store, backend, updates, grad_norms, stepper, trace, plans,
                 model, dp_group=None, before_training_pass=None) -> None:
        self.config, self.window, self.store, self.backend = config, window, store, backend
        self.updates, self.stepper, self.trace, self.plans = updates, stepper, trace, plans
        self.grad_norms = grad_norms  # grad_norms.BlockGradNorms: before or after the copy-out
        self.model, self.dp_group = model, dp_group
        self.before_training_pass = before_training_pass  # the engine's requires_grad check, or None
        self.overlap = overlap  # the overlap mode in effect ("auto" resolved)
        self.n_streamed = len(window.params)
        self._plan = None  # the plan of the pass in progress
        self._pos = 0  # index of the next use in the plan
        self._loads: dict[int, object] = {}  # block -> handle of its last load
        self._load_leases: dict[int, object] = {}  # block -> its load's disk lease (reads to check)
        self._pending: list[int] = []  # blocks whose load waits for their host update
        self._grad_out: dict[int, object] = {}  # block -> handle of its gradient copy-out
        self._grad_valid = [False] * self.n_streamed  # host grad holds earlier micro-batches' sum
        self._block_backwards = [0] * self.n_streamed  # each block's backward uses since the last step
        self._copies: list[tuple[str, int, object]] = []  # for the trace
        if config.strict:
            # NOTE: fresh device memory holds whatever was there (zeros, often): poisoned too, a read
            # before a slot's first load lands shows as NaN rather than as plausible numbers
            for slot in window.slots:
                backend.poison(slot.params)
                backend.poison(slot.grads)
            # NOTE: queued after the window's zero-fill marker: each slot's first load (the copy
            # stream) waits for a marker recorded after the NaN fill too, or it may land under it
            poisoned = backend.compute_marker()
            if poisoned is not None:
                for slot in window.slots:
                    slot.busy.append(poisoned)
        self.micro_batches = 0
        """Backward passes since the last step."""
        self.test_skip_waits: set[str] = set()
        """Test hook: {"load"} removes the compute-waits-for-load, {"restore"} the wait for offloaded
        block inputs (strict mode must then catch it)."""
        self.relay = None
        """The ``relay.Relay`` pass in progress (set by ``relay.accumulate``), or None."""
        self.relay_activations: dict | None = None
        """The last relay pass's saved block inputs: ``device_bytes`` kept, ``staged_bytes`` staged."""
        self.saved_inputs: SavedInputs | None = None
        """The saved block inputs of the training pass in progress under ``offload_block_inputs``
        (``saved_inputs.py``; the relay has its own), or None."""
        self.input_offload: dict | None = None
        """The last such pass's saved block inputs: ``device_bytes`` kept, ``staged_bytes`` offloaded,
        ``disk_bytes`` of those written on to the NVMe tier."""
        self.input_spill = (InputSpill(config.nvme_dir) if config.nvme_dir is not None
                            and config.offload_block_inputs is not False else None)
        """Where offloaded block inputs past host memory go (``input_spill.py``; with ``nvme_dir``), or None."""
        self.layer_drop = LayerDrop(self.n_streamed, config.layer_drop, config.layer_drop_seed)
        """Which streamed blocks run this step (``layer_drop.py``)."""

    def in_pass(self) -> bool:
        """True between a forward's first block and the end of its backward (or of an inference pass)."""
        return self._plan is not None

    def in_flight(self) -> int:
        """Copies and host jobs not finished yet."""
        return sum(not h.done() for _, _, h in self._copies) + self.updates.in_flight()

    def synchronize(self, updates: bool = True) -> None:
        """Wait for every copy and host update in flight (forward-overlap updates included);
        ``updates=False``: for the device's work and the copies only (``Engine.synchronize``)."""
        if updates:
            self.updates.drain()
        for _, _, h in self._copies:
            h.wait()
        self.backend.synchronize()
        if updates:  # the file tier's I/O: the host updates' reads and write-backs among it
            self.store.synchronize()
        self.flush_copies(calibrate=True)

    def track_copy(self, kind: str, block: int, handle) -> None:
        """A copy issued outside the executor (``kind`` "act_d2h"/"act_h2d": saved block inputs):
        ``synchronize`` and ``in_flight`` count it, the trace records it once done."""
        self._copies.append((kind, block, handle))

    def span(self, kind: str, block: int | None, *, host: bool = False):
        """Trace ``kind``: timed by the backend's clock (CUDA: events on the compute stream), or by
        the host's when ``host`` (work the host itself waits for)."""
        if not self.trace.enabled:
            return contextlib.nullcontext()
        return self.trace.span(kind, block, clock=None if host else self.backend.clock)

    # ---- the schedule, driven by block_fn.BlockFunction (through Engine.enter/leave)

    def enter(self, block: int, phase: str, train: bool) -> None:
        """Before ``block`` computes in ``phase``: its load is issued and waited for; params bound."""
        use = self._next_use()
        # a relay pass's later micro-batches and a pipeline step plan's later passes continue the plan
        if phase == "fwd" and block == self._first_block(train) and use != Use("fwd", block) \
                and not self._continues_relay_forward():
            self._begin_pass(train)
            use = self._next_use()
        plan = self._plan
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
        if handle is not None and "load" not in self.test_skip_waits:
            if handle.done():
                self.backend.compute_wait(handle)
            else:
                with self.span("wait", block):
                    self.backend.compute_wait(handle)
        if phase == "bwd" and self._grad_valid[block] and plan.run_bounds(self._pos)[0]:
            # accumulation: the earlier micro-batches' sum comes back so this one adds to it (a
            # relay run of m uses: before the first; the others add to it in the slot)
            slot = self.window.resident[block]
            n = self.store.layouts[block].train_numel
            lease = self.store.acquire(block, ["grad"])
            lease.wait()
            # NOTE: after the previous micro-batch's copy-out of this block (another queue/stream)
            h = self.backend.h2d(slot.grads[:n], lease.tensors["grad"], after=[self._grad_out.get(block)],
                                 timed=self.trace.enabled)
            self.store.release(lease, after=[h])
            self._copies.append(("h2d", block, h))
            with self.span("wait", block):
                self.backend.compute_wait(h)
        self.window.bind(block)

    def leave(self, block: int, phase: str, param_grads=None) -> None:
        """After ``block`` computed: in backward hand its gradient out; then run the plan's actions."""
        if phase == "bwd":
            self._grad_to_host(block, param_grads)
            plan, pos = self._plan, self._pos
            if block == plan.uses[-1].block and plan.run_bounds(pos)[1]:
                # a backward pass ends with its first block: one micro-batch (a pipeline step plan
                # holds several passes), or a relay run's m at once
                self.micro_batches += plan.run_length(pos)
        for action in self._plan.after[self._pos]:
            if isinstance(action, Release):
                self._release(action)
            else:
                self._load(action)
        self._pos += 1
        if self._pos == len(self._plan.uses):
            self._plan = None
            self._end_input_offload()
            self.flush_copies()  # finished copies go to the trace and are dropped

    def use_step_plan(self, plan, train: bool = True) -> None:
        """Run training (``train``) or inference passes with ``plan`` (``schedule.plan_uses``) over a
        whole step's passes instead of one pass (``Engine.use_step_plan``); each use is still
        checked as it happens."""
        if self._plan is not None:
            raise RuntimeError("use_step_plan during a forward/backward pass")
        self.plans[train] = plan

    def _next_use(self):
        """The use the plan in progress expects next (None outside a pass)."""
        plan = self._plan
        return plan.uses[self._pos] if plan is not None and self._pos < len(plan.uses) else None

    def count_backward(self, grad) -> None:
        """Multi-grad hook when every block is resident: a backward pass reached their gradients."""
        self.micro_batches += 1

    def _begin_pass(self, train: bool) -> None:
        if self._plan is not None:
            log.warning("a new forward started before the previous pass finished (no backward?); "
                        "abandoning it")
            self._abandon_pass()
        if train and self.before_training_pass is not None:
            self.before_training_pass()
        if train and self.micro_batches + self._pass_micro_batches(train) > self.config.accumulation_steps:
            raise RuntimeError(f"a training forward after {self.micro_batches} backward passes without "
                               f"step() (accumulation_steps={self.config.accumulation_steps})")
        self._plan, self._pos = self._plan_for(train), 0
        offload = self.config.offload_block_inputs
        if train and offload is not False and self.relay is None:
            self.saved_inputs = SavedInputs(self.backend, 0 if offload is True else offload, strict=self.config.strict,
                                            track=self.track_copy, timed=self.trace.enabled, spill=self.input_spill)
            self.saved_inputs.skip_restore_wait = "restore" in self.test_skip_waits
        for action in self._plan.prologue:
            self._load(action)

    # ---- relay and layer drop: which plan a pass follows

    def layer_dropped(self, block: int, train: bool) -> bool:
        """Whether ``block`` is skipped in this forward (a training forward of a layer-drop step; the
        step's draw is made at its first block call)."""
        if not (train and self.layer_drop.enabled and self.model.training):
            return False
        if self._plan is None and self.micro_batches == 0:
            self.layer_drop.draw_if_new_step()
        return self.layer_drop.dropped(block)

    def active_blocks(self, train: bool = True) -> list[int] | None:
        """The streamed blocks a training pass runs this step, in order (None: all of them)."""
        return self.layer_drop.active if train and self.model.training else None

    def _continues_relay_forward(self) -> bool:
        """Micro-batches 1..m-1 of a relay pass entering the first block continue the pass."""
        plan = self._plan
        return self.relay is not None and plan is not None and 0 < self._pos < plan.micro_batches

    def _pass_micro_batches(self, train: bool) -> int:
        """Micro-batches of the pass about to start (m in a relay pass, else 1)."""
        return self.relay.micro_batches if train and self.relay is not None else 1

    def _first_block(self, train: bool) -> int:
        active = self.active_blocks(train)
        return active[0] if active else 0

    def _plan_for(self, train: bool):
        """The plan of a pass: each use repeated m times in a relay pass; over the blocks that run in
        a layer-drop step. Built once per (train, m, blocks)."""
        m, active = self._pass_micro_batches(train), self.active_blocks(train)
        if m == 1 and active is None:
            return self.plans[train]
        key = (train, m, None if active is None else tuple(active))
        if key not in self.plans:
            window = len(self.window.slots) if active is None else min(len(self.window.slots), len(active))
            self.plans[key] = build_plan(self.n_streamed, window, train, micro_batches=m, blocks=active)
        return self.plans[key]

    def abandon_pass(self) -> None:
        """Drop the pass in progress (a failed relay pass): loads waited for, slots vacated."""
        if self._plan is not None:
            self._abandon_pass()

    def _abandon_pass(self) -> None:
        for h in self._loads.values():
            h.wait()
        self._loads.clear()
        self._load_leases.clear()
        self._pending.clear()
        for block in list(self.window.resident):
            self.window.vacate(block)
        self._plan = None
        if self.saved_inputs is not None:
            self.saved_inputs.discard()
            self.saved_inputs = None

    def _end_input_offload(self) -> None:
        """A pass ended: its saved block inputs are all back (its figures kept in ``input_offload``)."""
        inputs, self.saved_inputs = self.saved_inputs, None
        if inputs is None:
            return
        self.input_offload = dict(device_bytes=inputs.device_bytes, staged_bytes=inputs.staged_bytes,
                                  disk_bytes=inputs.disk_bytes)
        inputs.discard()  # nothing left when every block's backward ran

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
                                  after=[*slot.busy, *lease.read_handles()], timed=self.trace.enabled)
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
        if self.config.strict:
            # NOTE: poisoned before the release marker is recorded, so the next load into the slot
            # (which waits for the marker) comes after the NaN fill; and after the slot's copy-out
            for h in slot.busy:
                self.backend.compute_wait(h)
            self.backend.poison(slot.params)
            self.backend.poison(slot.grads)
        marker = self.backend.compute_marker()
        if marker is not None:
            slot.busy.append(marker)

    def _grad_to_host(self, block: int, param_grads) -> None:
        """``param_grads``: one per trainable parameter of ``block`` (None: no gradient)."""
        layout = self.store.layouts[block]
        if layout.train_numel == 0:
            return  # a wholly frozen block: no gradient to copy out, no update
        slot = self.window.resident[block]
        run_first, run_last = self._plan.run_bounds(self._pos)  # a relay run: m uses of a block in a row
        accumulate = self._grad_valid[block] or not run_first
        for view, g in zip(self.window.grad_views(block), param_grads):
            if g is not None:
                view.add_(g) if accumulate else view.copy_(g)
            elif not accumulate:
                view.zero_()
        if not accumulate:
            layout.zero_gaps(slot.grads[:layout.train_numel])
        if not run_last:
            return  # a relay run: the sum stays in the slot until the block's last micro-batch
        # NOTE: counted per block: an interleaved pipeline stage runs its chunks' last backward
        # passes at different times (a later chunk's blocks finish first)
        self._block_backwards[block] += self._plan.run_length(self._pos)
        last = self._block_backwards[block] >= self.config.accumulation_steps
        if last:
            # data parallelism: the block's whole gradient (all micro-batches) averaged over the DP
            # ranks in one all_reduce, where it is now: in the device slot, before the copy-out
            average_(slot.grads[:layout.train_numel], self.dp_group)
        streamed = last and self.overlap == "backward"
        # NOTE: a streamed update stages its optimizer states now, so their disk reads overlap the copy-out
        states = ["grad", *self.updates.update_states] if streamed else ["grad"]
        if last and self.config.needs_global_grad:  # the device path's norms: from the slot, pre copy-out
            self.grad_norms.before_copy_out(block, self.window.grad_views(block), self.stepper.grad_unscale())
        lease = self.store.acquire(block, states, fresh=["grad"])
        handle = self.backend.d2h(lease.tensors["grad"], slot.grads[:layout.train_numel],
                                  after=[self.backend.compute_marker()], timed=self.trace.enabled)
        slot.busy.append(handle)
        self._grad_out[block] = handle
        self._copies.append(("d2h", block, handle))
        self._grad_valid[block] = True
        if streamed:
            speculative = self.config.needs_global_grad  # backward overlap with it: clip_mode's speculation
            if speculative:  # the norms too: the step checks the coefficient 1 assumed here
                self.grad_norms.after_copy_out(block, handle, self.stepper.grad_unscale())
            hyper = self.stepper.block_hyper(block, self.stepper.grad_unscale())  # fp16: unscaled, not clipped
            self.updates.submit_update(block, handle, hyper=hyper,
                                       lease=lease, step=self.stepper.attempted_steps + 1,
                                       speculate=speculative)
            if block > 0:
                self.store.prefetch(block - 1, self.updates.update_states)
            return
        self.store.release(lease, dirty=["grad"], after=[handle])
        if last and self.config.needs_global_grad:
            self.grad_norms.after_copy_out(block, handle, self.stepper.grad_unscale())  # the host path

    # ---- between passes: the step's side of the gradients

    def finish_accumulation(self) -> None:
        """Before a step: no pass in progress, every micro-batch's backward done (else RuntimeError),
        every gradient copy-out finished."""
        if self._plan is not None:
            raise RuntimeError("step() during a forward/backward pass")
        if self.micro_batches != self.config.accumulation_steps:
            raise RuntimeError(f"step() after {self.micro_batches} backward passes; accumulation_steps="
                               f"{self.config.accumulation_steps} must be completed first")
        for h in self._grad_out.values():
            h.wait()
        self._grad_out.clear()

    def end_accumulation(self) -> None:
        """After a step (taken or skipped): the next backward starts a new gradient sum (and, with
        layer drop, the next training forward draws the blocks anew)."""
        self.layer_drop.end_step()
        self.micro_batches = 0
        self._grad_valid = [False] * self.n_streamed
        self._block_backwards = [0] * self.n_streamed
        self.flush_copies(calibrate=True)

    def forget_grads(self) -> None:
        """``zero_grad`` between passes: the block gradients accumulated so far are dropped."""
        if self._plan is None and self.micro_batches:
            self.layer_drop.end_step()
            self.micro_batches = 0
            self._grad_valid = [False] * self.n_streamed
            self._block_backwards = [0] * self.n_streamed

    def flush_copies(self, calibrate: bool = False) -> None:
        """Finished copies go to the trace and are dropped; with ``calibrate`` (step end, sync) the
        trace's device-timed spans are placed on the host clock (runtime/tracing/timing.py)."""
        self._copies.extend(self.store.take_events())
        keep = []
        for kind, block, h in self._copies:
            if h.done():
                marks = copy_marks(h) if self.trace.enabled else None
                if marks is not None:  # None: a CUDA copy issued while the trace was off
                    self.trace.defer(kind, block, *marks, h.nbytes)
            else:
                keep.append((kind, block, h))
        self._copies = keep
        if calibrate and self.trace.pending():
            self.trace.resolve(self.backend.clock.calibrate)
