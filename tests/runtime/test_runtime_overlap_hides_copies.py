"""The central claim, on the CPU backend: copies run behind compute. While block i computes, the
window's other slot takes the next block's load (forward), the backward's reload of the block after
it, or block i+1's gradient copy-out (backward).

Copies are slowed by a test double of the copy engine (``SlowCopies``: every load and copy-out
held ``COPY_S`` on its queue's worker) and compute by blocks that sleep ``COMPUTE_S`` in their
forward and in their backward. Sleeps, not arithmetic, set both, so they hold on a loaded machine.
The claim is read from the intervals the trace recorded (copy workers and compute stamp their own
start and end), never from wall-time ratios: each copy of a pair below shares time with the
compute it belongs behind. The two durations are the margin for scheduling delays on a loaded
machine: a copy may start about COMPUTE_S late, or its compute about COPY_S late, and the pair
still overlaps. With one slot the same pairs cannot overlap, by the schedule's own order (the next
load waits for the slot): the check tells the two apart.
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

COMPUTE_S = 0.15
"""Seconds each block computes per pass (forward, recompute, backward)."""
COPY_S = 0.1
"""Seconds each copy (load, reload, gradient copy-out) takes."""
BLOCKS = 4


class _Sleep(torch.autograd.Function):
    """Identity that takes ``seconds`` in its forward and in its backward (a slow kernel)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _SlowBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + _Sleep.apply(torch.tanh(self.fc(x)), COMPUTE_S)


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


def _one_step_trace(window: int):
    """The trace events of one training step with slow compute and slow copies."""
    model = _SlowStack()
    engine = ph.wrap(model, blocks=model.blocks, window=window, trace=True)
    engine.backend.copies = SlowCopies(engine.backend.copies, delay_s=COPY_S, queues=(0, 1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)
    try:
        engine.backward(engine(x, y))
        engine.step()
        engine.synchronize()
        return engine.trace.events()
    finally:
        engine.close()


def _shared_s(a, b) -> float:
    """Seconds the intervals ``a`` and ``b`` ((start, end) pairs) have in common."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _copy_behind_compute(events) -> dict[str, float]:
    """Per pair ("copy of block j behind compute of block i"): the seconds they shared."""
    one = {}
    loads: dict[int, list] = {}
    for e in sorted(events, key=lambda e: e.start_s):
        if e.kind == "h2d":
            loads.setdefault(e.block, []).append((e.start_s, e.end_s))
        elif e.kind in ("compute_fwd", "recompute", "compute_bwd", "d2h"):
            one[e.kind, e.block] = (e.start_s, e.end_s)
    fwd = {b: one["compute_fwd", b] for b in range(BLOCKS)}
    # a block's backward: its recompute, then its backward proper
    bwd = {b: (one["recompute", b][0], one["compute_bwd", b][1]) for b in range(BLOCKS)}
    pairs = {f"load of {i + 1} behind forward of {i}": _shared_s(loads[i + 1][0], fwd[i]) for i in range(BLOCKS - 1)}
    for j, spans in loads.items():  # the backward's reloads: blocks that left the window in the forward
        if len(spans) > 1:
            pairs[f"reload of {j} behind backward of {j + 1}"] = _shared_s(spans[1], bwd[j + 1])
    for j in range(1, BLOCKS):
        pairs[f"copy-out of {j} behind backward of {j - 1}"] = _shared_s(one["d2h", j], bwd[j - 1])
    return pairs


def test_each_copy_runs_while_the_block_before_it_computes():
    pairs = _copy_behind_compute(_one_step_trace(window=2))
    # 3 forward loads, the reloads of blocks 0 and 1 (2 and 3 stay in the window), 3 copy-outs
    assert len(pairs) == 3 + 2 + 3, pairs
    assert all(shared > 0 for shared in pairs.values()), pairs
    # one slot: the next block's load waits for the slot, so nothing can run behind compute
    serial = _copy_behind_compute(_one_step_trace(window=1))
    assert len(serial) == 3 + 3 + 3 and all(shared == 0 for shared in serial.values()), serial
