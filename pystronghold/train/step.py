"""One optimizer step and one validation pass of a built train run: batches to this replica's
slices on the device, the loss through the engine (or the pipeline's schedule), weighted so that
the data-parallel average is the global batch's mean, and the optimizer and LR schedule stepped.
"""

from __future__ import annotations

import torch

from pystronghold.data import IGNORE_INDEX
from pystronghold.models.hf_loss import chunked_causal_lm_loss

__all__ = ["Stepper"]


class Stepper:
    """The step of a built run: ``engine`` (or this rank's ``pipeline`` stage), ``scheduler``, the
    process ``groups`` (None: one process) and ``uneven`` (``train.uneven.UnevenBatch`` of
    --dp-split, or None). ``hf_model``: the Hugging Face model whose loss runs in chunks of
    ``loss_chunk`` tokens (None: our GPT, whose tail computes its own)."""

    def __init__(self, *, engine, scheduler, groups=None, pipeline=None, uneven=None, hf_model=None,
                 loss_chunk: int = 0, accumulation: int = 1) -> None:
        self.engine, self.scheduler, self.groups, self.pipeline = engine, scheduler, groups, pipeline
        self.uneven, self.hf_model, self.loss_chunk, self.accumulation = uneven, hf_model, loss_chunk, accumulation
        self.dp_size = groups.dp_size if groups is not None else 1
        self.dp_rank = groups.dp_rank if groups is not None else 0

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss of inputs ``x`` against shifted targets ``y`` (B, T) through the engine."""
        if self.hf_model is not None:
            tp_group = self.groups.tp_group if self.groups is not None else None
            return chunked_causal_lm_loss(self.engine.call, self.hf_model, x, y, self.loss_chunk, tp_group)
        return self.engine(x, y)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's slice of a global batch."""
        if self.uneven is not None:
            return self.uneven.local(t)
        if self.dp_size > 1:
            per = t.shape[0] // self.dp_size
            return t[self.dp_rank * per:(self.dp_rank + 1) * per]
        return t

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """This DP rank's slice of a global batch, on the device."""
        return self.local(t).to(self.engine.device, non_blocking=True)

    def target_weights(self, targets: list[torch.Tensor]) -> list[float]:
        """What the mean losses of this replica's slices of the micro-batches ``targets`` ((B, T)
        each) are multiplied by, so that their mean over the micro-batches, averaged over the DP
        replicas, is the mean loss over every target of the global batches (``IGNORE_INDEX`` targets
        do not count): this slice's count of targets times m * dp / the global count. With every
        target counted: ``loss_weight``; with none: 0 (no gradient)."""
        total = sum(int((y != IGNORE_INDEX).sum()) for y in targets)
        if total == sum(y.numel() for y in targets):
            return [self.loss_weight] * len(targets)
        scale = len(targets) * self.dp_size
        return [int((self.local(y) != IGNORE_INDEX).sum()) * scale / max(total, 1) for y in targets]

    @property
    def loss_weight(self) -> float:
        """What this replica's mean loss is multiplied by: 1, or with --dp-split its share of the
        batch times the DP size (``UnevenBatch.weight``), so the DP average is the batch's mean."""
        return 1.0 if self.uneven is None else self.uneven.weight

    def dp_mean(self, value: float) -> float:
        """The global batch's mean of ``value``, this replica's mean loss: the DP average of the
        weighted means (``loss_weight``)."""
        if self.dp_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value * self.loss_weight], dtype=torch.float64)
        if dist.get_backend(self.groups.dp_group) == "nccl":
            t = t.to(self.engine.device)
        dist.all_reduce(t, group=self.groups.dp_group)
        return float(t.item()) / self.dp_size

    def train_step(self, sampler) -> float:
        """One optimizer step on the next batches of ``sampler`` (``accumulation`` micro-batches);
        returns the mean micro-batch loss."""
        if self.pipeline is not None:  # the micro-batches go through the stages in one schedule step
            x, y = sampler.next_batch()
            loss = self.pipeline.step(self.to_device(x), self.to_device(y))
            self.scheduler.step()
            return self.dp_mean(loss)
        acc = self.accumulation
        batches = [sampler.next_batch() for _ in range(acc)]  # (B, T) int64 each
        # NOTE: through engine.accumulate, which runs the micro-batches one after the other or, with
        # --schedule relay, layer-major; each back-propagates loss / acc. Uneven data parallelism
        # (--dp-split) and targets left out of the loss weight each micro-batch (target_weights).
        weights = self.target_weights([y for _, y in batches])

        def micro_batch_loss(item):
            (x, y), weight = item
            loss = self.loss(self.to_device(x), self.to_device(y))
            return loss if weight == 1.0 else loss * weight

        losses = self.engine.accumulate(list(zip(batches, weights)), micro_batch_loss)
        total = sum(float(v) for v in losses) / self.loss_weight
        self.engine.step()
        self.scheduler.step()
        self.engine.zero_grad()
        return self.dp_mean(total / acc)

    def barrier(self) -> None:
        """Wait for every process of the run (none to wait for with one)."""
        if self.groups is not None:
            import torch.distributed as dist

            dist.barrier()

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean loss over the validation ``batches`` (the same value on every rank), in eval mode
        (no dropout) through the window without gradients."""
        if self.pipeline is not None:
            losses = [self.pipeline.evaluate(self.to_device(x), self.to_device(y)) for x, y in batches]
            return self.dp_mean(sum(losses) / len(losses))
        self.engine.eval()
        try:
            weights = self.target_weights([y for _, y in batches])
            losses = [float(self.loss(self.to_device(x), self.to_device(y))) * (w / self.loss_weight)
                      for (x, y), w in zip(batches, weights)]
        finally:
            self.engine.train()
        return self.dp_mean(sum(losses) / len(losses))
