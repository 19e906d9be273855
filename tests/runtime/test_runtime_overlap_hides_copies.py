"""The central claim, on the CPU backend: copies run behind compute, so a step takes about
max(compute, copies), not their sum.

Copies are slowed by a test double of the copy engine (``SlowCopies``: every load and copy-out
held ``DELAY_S`` on its queue's worker) and compute by blocks that sleep ``DELAY_S`` in their
forward and in their backward. Sleeps, not arithmetic, set both, so the figures hold on a loaded
machine. The parts are counted, not timed: a step that ran n sleeps and m slow copies one after
the other took at least (n + m) * DELAY_S, so a wall time well below that is overlap, whatever the
trace or the scheduler say. Every figure is measured in the test itself: no absolute time bound.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pystronghold as ph
from runtime_models import SlowCopies, one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)

DELAY_S = 0.04
"""Seconds each block computes per pass (forward, recompute, backward) and each copy takes."""
BLOCKS = 8
STEPS = 3


class _Sleep(torch.autograd.Function):
    """Identity that takes ``seconds`` in its forward and in its backward (a slow kernel);
    ``calls`` counts the sleeps."""

    calls = 0

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        _Sleep.calls += 1  # compute runs on the calling thread only
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _Sleep.calls += 1
        time.sleep(ctx.seconds)
        return grad, None


class _SlowBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + _Sleep.apply(torch.tanh(self.fc(x)), DELAY_S)


class _SlowStack(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.head = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_SlowBlock(d) for _ in range(BLOCKS))
        self.tail = nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.tail(h), y)


def _step_times(window: int) -> tuple[float, float, float]:
    """(wall, compute, copies) seconds of the steps after the first (which warms up): the wall time
    measured, compute and copies as counted sleeps and slow copies x ``DELAY_S``."""
    model = _SlowStack()
    engine = ph.wrap(model, blocks=model.blocks, window=window)
    copies = engine.backend.copies = SlowCopies(engine.backend.copies, delay_s=DELAY_S, queues=(0, 1))
    g = torch.Generator().manual_seed(0)
    wall = 0.0
    try:
        for step in range(STEPS):
            x, y = torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)
            if step == 1:
                sleeps, served = _Sleep.calls, copies.served
            start = time.monotonic()
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
            engine.synchronize()
            wall += (time.monotonic() - start) if step else 0.0
    finally:
        engine.close()
    return wall, (_Sleep.calls - sleeps) * DELAY_S, (copies.served - served) * DELAY_S


def test_a_step_takes_about_the_longer_of_compute_and_copies_not_their_sum():
    serial_wall, _, _ = _step_times(window=1)
    wall, compute, copies = _step_times(window=2)
    # per step and block: forward, recompute and backward each sleep; a load, most blocks a
    # reload for the backward, and a gradient copy-out (the schedule's own counts)
    assert compute == pytest.approx((STEPS - 1) * 3 * BLOCKS * DELAY_S)
    assert copies >= (STEPS - 1) * 2 * BLOCKS * DELAY_S
    # one after the other the step would take >= compute + copies (ratio >= 1); behind each
    # other about max(compute, copies) plus the pipeline's fill (ratio about 0.6)
    ratio = wall / (compute + copies)
    assert ratio < 0.8, (f"{STEPS - 1} steps took {wall:.3f} s for {compute:.3f} s of compute and "
                         f"{copies:.3f} s of copies: copies did not overlap compute (ratio {ratio:.2f})")
    # a window of one slot cannot load the next block while this one computes: the same work,
    # serialised, takes visibly longer
    assert wall < 0.8 * serial_wall, (wall, serial_wall)
