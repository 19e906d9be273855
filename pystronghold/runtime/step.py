"""The optimizer step of the engine: global gradient norm, fp16 overflow, clip coefficient, updates.

``OptimizerStep`` runs once every accumulated gradient is in place: data-parallel averaging, then
either the streamed path (block updates already ran during backward) or the whole-model path
(global norm, overflow skip, clip coefficient, host and device updates). It owns the step counters
and the loss scaler, and stops a diverged run (``divergence.py``). See docs/DESIGN.md "The step".
"""

from __future__ import annotations

import logging
import math

import torch

from pystronghold.parallel.data import any_rank, average_grads_, global_grad_norm, is_pipeline_copy, is_tp_shard
from pystronghold.parallel.groups import group_size
from pystronghold.runtime.optimizer.divergence import DivergenceError, describe_nonfinite

__all__ = ["OptimizerStep"]

log = logging.getLogger(__name__)


class OptimizerStep:
    """The engine's step (private to it): updates every parameter from the gradients of the finished passes.

    ``optimizer`` gives the live hyper-parameters (``WindowOptimizer.hyper()``); ``window``: its
    ``params`` (placeholder ``Parameter`` objects of each streamed block) place the block norms in
    ``model.parameters()`` order; ``scaler``: the fp16 ``DynamicLossScaler`` or None.
    """

    def __init__(self, *, model, config, overlap: str, optimizer, device_optimizer, resident, updates, grad_norms,
                 window, scaler, dp_group=None, tp_group=None, pp_group=None, parallel: bool = False) -> None:
        # NOTE: the engine's names for its parts, so the step reads as it did inside Engine
        self.model, self.config, self.optimizer = model, config, optimizer
        self.device_optimizer, self.resident, self.updates = device_optimizer, resident, updates
        self.grad_norms = grad_norms  # grad_norms.BlockGradNorms: the streamed blocks' norms
        self.window, self.n_streamed = window, len(window.params)
        self.dp_group, self.tp_group, self.parallel = dp_group, tp_group, parallel
        self.pp_group = pp_group  # pipeline stages: gradient norms summed over them
        self.overlap = overlap  # the overlap mode in effect ("auto" resolved)
        self.scaler = scaler
        """fp16 loss scaler (``DynamicLossScaler``), or None in fp32/bf16."""
        self._steps = 0
        self.block_steps = [0] * self.n_streamed
        """AdamW steps each streamed block has taken: its bias correction's count. Equal to ``steps``
        unless layer drop skipped the block in some steps (no gradient: no update, no count, as
        ``torch.optim.AdamW`` does for a parameter whose ``.grad`` is None)."""
        self.skipped_steps = 0
        """fp16 steps skipped for an overflow."""
        self.grad_norm: float | None = None
        """The last step's global gradient norm (only computed for clipping or fp16)."""

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped fp16 steps not counted). Setting it (a checkpoint or state
        dict loaded) sets every block's count too (``block_steps``)."""
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        self._steps = int(value)
        self.block_steps = [self._steps] * self.n_streamed

    def block_hyper(self, block: int, grad_scale: float = 1.0) -> list:
        """``hyper`` for streamed ``block``'s next update (its own step count, ``block_steps``)."""
        return self.hyper(self.block_steps[block] + 1, grad_scale=grad_scale)

    @property
    def next_step(self) -> int:
        """Number of the step the current gradients will make (AdamW's bias correction count)."""
        return self.steps + 1

    def hyper(self, step: int, grad_scale: float = 1.0) -> list:
        """One ``AdamWHyper`` per param group for step ``step`` (``WindowOptimizer.hyper``);
        ``grad_scale`` multiplies every gradient (fp16 unscale times the clip coefficient)."""
        return self.optimizer.hyper(step, grad_scale=grad_scale)

    def grad_unscale(self) -> float:
        """Factor that turns a stored gradient into the true one (1 / loss scale in fp16, else 1)."""
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    @property
    def attempted_steps(self) -> int:
        """Steps taken or skipped: the number a user counts (``engine.step()`` calls)."""
        return self._steps + self.skipped_steps

    def check_loss_scaled(self, backward_passes: int) -> None:
        """fp16: RuntimeError unless each of the step's ``backward_passes`` went through the scaled
        loss (a plain ``loss.backward()`` gives gradients the unscale would shrink by the scale).
        A pipeline stage is exempt: the pipeline scales the loss on its last stage only."""
        if self.scaler is None or group_size(self.pp_group) > 1:
            return
        scaled = self.scaler.take_scaled_backwards()
        if scaled < backward_passes:
            raise RuntimeError(
                f"fp16: {backward_passes - scaled} of this step's {backward_passes} backward passes did not go "
                "through the loss scale (a plain loss.backward()?); call engine.backward(loss), which scales "
                "the loss, or back-propagate engine.scale_loss(loss)")

    def run(self, blocks: list[int] | None = None) -> None:
        """One step over head, tail, resident and streamed blocks; the caller has waited for every
        gradient copy-out. An fp16 overflow skips the whole step (``skipped_steps`` counts it);
        ``DivergenceError`` when the run cannot go on (inf/NaN gradients in bf16/fp32, fp16 skips
        at the scale's floor or ``max_skipped_steps`` in a row), before anything is updated.
        ``blocks``: the streamed blocks that ran this step (a layer-drop step; None: all); the
        others are not updated."""
        average_grads_(self.device_optimizer.params + self.resident.params, self.dp_group)  # one bucket
        step = self.next_step
        # speculative (clip_mode): backward overlap although the step needs the global norm; the
        # blocks' updates assumed coefficient 1 and are settled below
        speculative = self.overlap == "backward" and self.config.needs_global_grad
        if self.overlap == "backward":
            self.updates.drain()
        if self.overlap == "backward" and not speculative:
            hyper = self.hyper(step)
            self.device_optimizer.step(hyper)
            self.resident.step(hyper, self.steps)
        else:
            scale = self.grad_unscale()
            coef = 1.0
            if self.config.needs_global_grad:
                params, norms = self._param_grad_norms(scale)
                total = self.grad_norm = global_grad_norm(norms, [is_tp_shard(p) for p in params],
                                                          self.tp_group, pp_group=self.pp_group)
                if self.scaler is not None:
                    overflow = not math.isfinite(total)
                    if self.parallel:  # every rank skips together, or none does
                        overflow = any_rank(overflow)
                    self.scaler.update(overflow)
                    if overflow:
                        if speculative:
                            self._settle_speculation(blocks, None)
                        log.info("fp16 overflow: step skipped for every block; loss scale now %g",
                                 self.scaler.scale)
                        self.skipped_steps += 1
                        self._stop_if_skipping_for_good()
                        return
                elif not math.isfinite(total):  # the norm is reduced over the ranks: all stop here
                    if speculative:
                        self._settle_speculation(blocks, None)
                    raise DivergenceError(self.attempted_steps + 1, f"the gradient norm is {total}: "
                                          f"{self._nonfinite(params, norms)}; nothing was updated")
                if self.config.clip_grad_norm is not None:
                    # NOTE: the fp32 arithmetic of torch.nn.utils.clip_grad_norm_, for bit-exactness
                    coef = float(torch.clamp(self.config.clip_grad_norm / (torch.tensor(total) + 1e-6),
                                             max=1.0))
            hyper = self.hyper(step, grad_scale=scale * coef)
            if speculative:
                self._settle_speculation(blocks, scale * coef)
            # 0, 1, 2, ...: the order the next forward loads them (layer drop: the blocks that ran)
            for block in () if speculative else range(self.n_streamed) if blocks is None else blocks:
                if self.window.layouts[block].train_numel:  # a wholly frozen block has no update
                    self.updates.submit_update(block, None, hyper=self.block_hyper(block, scale * coef),
                                               step=self.attempted_steps + 1)
            self.device_optimizer.step(hyper)
            self.resident.step(hyper, self.steps)
            if self.overlap == "none":
                self.updates.drain()
        self._steps = step
        for block in range(self.n_streamed) if blocks is None else blocks:
            self.block_steps[block] += 1

    def _settle_speculation(self, blocks: list[int] | None, grad_scale: float | None) -> None:
        """After speculative updates (``clip_mode="speculative"``): each block whose applied hyper
        differs from the true one at ``grad_scale`` (a clipping coefficient below 1) is restored
        from its saved pre-step states and updated again, the "after-norm" arithmetic exactly;
        ``grad_scale`` None (a skipped or stopped step) restores them only, waiting for that."""
        updates = self.updates
        for block in range(self.n_streamed) if blocks is None else blocks:
            if not self.window.layouts[block].train_numel:
                continue
            hyper = None if grad_scale is None else self.block_hyper(block, grad_scale)
            if hyper is None or updates.speculated.get(block) != hyper:
                updates.submit_update(block, None, hyper=hyper, step=self.attempted_steps + 1, redo=True)
            else:
                updates.keep(block)
        if grad_scale is None:
            updates.drain()  # nothing of the step is left applied when the caller returns or raises

    def _param_grad_norms(self, grad_scale: float) -> tuple[list, list[torch.Tensor]]:
        """Every parameter with a gradient (head, blocks, tail) in model.parameters() order, and its
        gradient's L2 norm; ``global_grad_norm`` combines them (tensor-parallel shards summed over
        the TP group, pystronghold.parallel.data)."""
        norms = {**self.device_optimizer.grad_norms(grad_scale), **self.resident.grad_norms(grad_scale)}
        for block, per_param in self.grad_norms.take().items():
            for p, n in zip(self.window.trainable(block), per_param):
                norms[id(p)] = n
        # a pipeline's last-stage copy of a tied weight is counted once (by the first stage)
        params = [p for p in self.model.parameters() if id(p) in norms and not is_pipeline_copy(p)]
        return params, [norms[id(p)] for p in params]

    def _nonfinite(self, params: list, norms: list[torch.Tensor]) -> str:
        names = {id(p): name for name, p in self.model.named_parameters()}
        return describe_nonfinite([names.get(id(p), "?") for p in params], norms)

    def _stop_if_skipping_for_good(self) -> None:
        """DivergenceError after an fp16 overflow that backing off cannot cure: one at the floor
        scale, or the ``max_skipped_steps``-th in a row (every rank decides alike: the overflow
        verdict and so the scaler are the same on all)."""
        scaler, in_a_row = self.scaler, self.scaler.overflows_in_a_row
        if scaler.overflow_at_floor:
            why = f"the loss scale is at its floor, {scaler.min_scale:g}"
        elif in_a_row >= self.config.max_skipped_steps:
            why = f"that is max_skipped_steps (--max-skipped-steps {self.config.max_skipped_steps})"
        else:
            return
        raise DivergenceError(self.attempted_steps,
                              f"{in_a_row} steps in a row skipped for inf/NaN fp16 gradients ({self.skipped_steps} "
                              f"skipped in all) and {why}", skipped_steps=self.skipped_steps)

    def zero_grad(self) -> None:
        """Head/tail and resident gradients forgotten (``.grad`` None); the executor resets blocks'."""
        if self.updates.unsettled:  # gradients dropped without a step: their speculative updates undone
            self.updates.drain()
            self._settle_speculation(sorted(self.updates.unsettled), None)
        self.device_optimizer.zero_grad()
        self.resident.zero_grad()
        if self.scaler is not None:  # the forgotten passes' count goes with them
            self.scaler.take_scaled_backwards()
