"""Uneven data-parallel batches (Whale's hardware-aware ``replicate``): each DP rank takes its own
number of samples of the global batch, and the gradient stays the equal-split one.

``UnevenBatch.scale`` multiplies rank r's mean loss by w_r = b_r * n / B, so the runtime's DP
average equals the gradient of one process on the whole batch. ``add_compute_delay`` slows one
rank per sample (a sleeping pre-hook), to show an unlike GPU on CPU (``bench/whale.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.parallel.groups import group_size
from pystronghold.planner.balance import balance_batch, batch_slices, dp_loss_weight

__all__ = ["UnevenBatch", "add_compute_delay"]


@dataclass(frozen=True, slots=True)
class UnevenBatch:
    """This DP rank's share of a global batch split unevenly across the DP group."""

    sizes: tuple[int, ...]
    """Samples of each DP rank, in DP-rank order (sum: the global batch)."""
    dp_rank: int
    """This rank's index in its DP group."""

    def __post_init__(self) -> None:
        if not self.sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.sizes):
            raise ValueError(f"UnevenBatch.sizes must be positive ints, got {self.sizes!r}")
        if not 0 <= self.dp_rank < len(self.sizes):
            raise ValueError(f"UnevenBatch.dp_rank={self.dp_rank} is not in 0..{len(self.sizes) - 1}")

    @classmethod
    def from_speeds(cls, global_batch: int, speeds: list[float], dp_rank: int,
                    capacities: list[int] | None = None) -> "UnevenBatch":
        """Sizes proportional to each rank's ``speeds`` (samples/s), within ``capacities``
        (``pystronghold.planner.balance.balance_batch``)."""
        return cls(sizes=tuple(balance_batch(global_batch, speeds, capacities)), dp_rank=dp_rank)

    @property
    def global_batch(self) -> int:
        """Samples over all DP ranks."""
        return sum(self.sizes)

    @property
    def local_batch(self) -> int:
        """This rank's samples."""
        return self.sizes[self.dp_rank]

    @property
    def weight(self) -> float:
        """The factor of this rank's mean loss: local_batch * dp_size / global_batch."""
        return dp_loss_weight(self.local_batch, self.global_batch, len(self.sizes))

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 0) of the global ``batch``; ValueError on a batch of another size."""
        if batch.shape[0] != self.global_batch:
            raise ValueError(f"batch has {batch.shape[0]} samples, the split {list(self.sizes)} "
                             f"needs {self.global_batch}")
        return batch[batch_slices(list(self.sizes))[self.dp_rank]]

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate: this rank's mean loss times ``weight``."""
        return loss * self.weight

    def global_mean(self, loss: torch.Tensor, group: dist.ProcessGroup | None) -> float:
        """The mean loss over the global batch from each rank's mean (a collective over ``group``,
        the DP group; with one rank, the loss itself)."""
        if group_size(group) != len(self.sizes):
            raise ValueError(f"the DP group has {group_size(group)} ranks, the split {len(self.sizes)}")
        weighted = (loss.detach().float() * self.weight).reshape(1).cpu()
        if group_size(group) > 1:
            dist.all_reduce(weighted, group=group)
        return float(weighted) / len(self.sizes)


def add_compute_delay(model: nn.Module, seconds_per_sample: float):
    """Make every forward of ``model`` sleep ``seconds_per_sample`` per sample of its first
    argument (dim 0) first: a slower device, on CPU. Returns the hook handle (``.remove()``)."""
    if not seconds_per_sample >= 0:
        raise ValueError(f"seconds_per_sample must be >= 0, got {seconds_per_sample!r}")

    def delay(module, args):
        time.sleep(seconds_per_sample * args[0].shape[0])

    return model.register_forward_pre_hook(delay)
