"""The optimizer step of the engine: global gradient norm, fp16 overflow, clip coefficient, updates.

``OptimizerStep`` runs once the pass executor (``executor.py``) has every gradient of the
accumulated micro-batches on the host (blocks) or on the device (head, tail, resident blocks):
data-parallel averaging of the device gradients, then either the streamed path (overlap
"backward": block updates already ran during backward; only head/tail and resident blocks step
here) or the whole-model path (global norm when clipping or fp16 needs it, the overflow skip, the
clip coefficient, one host update per streamed block and the device updates). It owns the step
counters and the loss scaler. See docs/DESIGN.md "Window runtime".
"""

from __future__ import annotations

import logging
import math

import torch

from pystronghold.parallel.data import any_rank, average_grads_, global_grad_norm, is_pipeline_copy, is_tp_shard

__all__ = ["OptimizerStep"]

log = logging.getLogger(__name__)


class OptimizerStep:
    """``engine.stepper``: updates every parameter from the gradients of the finished passes.

    ``optimizer`` gives the live hyper-parameters (``WindowOptimizer.hyper()``); ``window``: its
    ``params`` (placeholder ``Parameter`` objects of each streamed block) place the block norms in
    ``model.parameters()`` order; ``scaler``: the fp16 ``DynamicLossScaler`` or None.
    """

    def __init__(self, *, model, config, optimizer, device_optimizer, resident, updates, grad_norms, window,
                 scaler, dp_group=None, tp_group=None, pp_group=None, parallel: bool = False) -> None:
        # NOTE: the engine's names for its parts, so the step reads as it did inside Engine
        self.model, self.config, self.optimizer = model, config, optimizer
        self.device_optimizer, self.resident, self.updates = device_optimizer, resident, updates
        self.grad_norms = grad_norms  # grad_norms.BlockGradNorms: the streamed blocks' norms
        self.window, self.n_streamed = window, len(window.params)
        self.dp_group, self.tp_group, self.parallel = dp_group, tp_group, parallel
        self.pp_group = pp_group  # pipeline stages: gradient norms summed over them
        self.overlap = config.overlap_mode
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

    def run(self, blocks: list[int] | None = None) -> None:
        """One step over head, tail, resident and streamed blocks; the caller has waited for every
        gradient copy-out. An fp16 overflow skips the whole step (``skipped_steps`` counts it).
        ``blocks``: the streamed blocks that ran this step (a layer-drop step; None: all); the
        others are not updated."""
        average_grads_(self.device_optimizer.params + self.resident.params, self.dp_group)  # one bucket
        step = self.next_step
        if self.overlap == "backward":
            self.updates.drain()
            hyper = self.hyper(step)
            self.device_optimizer.step(hyper)
            self.resident.step(hyper, self.steps)
        else:
            scale = self.grad_unscale()
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
                        return
                if self.config.clip_grad_norm is not None:
                    # NOTE: the fp32 arithmetic of torch.nn.utils.clip_grad_norm_, for bit-exactness
                    coef = float(torch.clamp(self.config.clip_grad_norm / (torch.tensor(total) + 1e-6),
                                             max=1.0))
            hyper = self.hyper(step, grad_scale=scale * coef)
            # 0, 1, 2, ...: the order the next forward loads them (layer drop: the blocks that ran)
            for block in range(self.n_streamed) if blocks is None else blocks:
                self.updates.submit_update(block, None, hyper=self.block_hyper(block, scale * coef))
            self.device_optimizer.step(hyper)
            self.resident.step(hyper, self.steps)
            if self.overlap == "none":
                self.updates.drain()
        self._steps = step
        for block in range(self.n_streamed) if blocks is None else blocks:
            self.block_steps[block] += 1

    def _global_grad_norm(self, grad_scale: float) -> float:
        """L2 norm over every gradient (head, blocks, tail), combined in model.parameters() order;
        tensor-parallel shards summed over the TP group (pystronghold.parallel.data)."""
        norms = {**self.device_optimizer.grad_norms(grad_scale), **self.resident.grad_norms(grad_scale)}
        for block, per_param in self.grad_norms.take().items():
            for p, n in zip(self.window.params[block], per_param):
                norms[id(p)] = n
        # a pipeline's last-stage copy of a tied weight is counted once (by the first stage)
        params = [p for p in self.model.parameters() if id(p) in norms and not is_pipeline_copy(p)]
        return global_grad_norm([norms[id(p)] for p in params], [is_tp_shard(p) for p in params],
                                self.tp_group, pp_group=self.pp_group)

    def zero_grad(self) -> None:
        """Head/tail and resident gradients forgotten (``.grad`` None); the executor resets blocks'."""
        self.device_optimizer.zero_grad()
        self.resident.zero_grad()
