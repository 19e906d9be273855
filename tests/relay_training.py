"""Training through engine.accumulate under either schedule (runtime/streaming/relay.py), shared by the relay's
runtime and planner tests."""

from __future__ import annotations

import torch

import pystronghold as ph
from runtime_models import HYPER

STEPS = 3


def train(model, batches, m, *, schedule, steps=STEPS, mean=True, **options):
    """``steps`` optimizer steps of ``m`` micro-batches through engine.accumulate. Returns (losses
    (steps, m), fp32 parameters, h2d events, d2h events, engine)."""
    engine = ph.wrap(model, blocks=model.blocks, optimizer=ph.AdamW(**HYPER, bitwise_torch=True),
                     accumulation_steps=m, schedule=schedule, trace=True, **options)
    try:
        losses = []
        for s in range(steps):
            losses.append(engine.accumulate(batches[s * m:(s + 1) * m], lambda b: engine(*b), mean=mean))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        events = engine.trace.events()
        params = {k: v.clone() for k, v in engine.master_parameters().items()}
    finally:
        engine.close()
    return (torch.stack(losses), params, [e for e in events if e.kind == "h2d"],
            [e for e in events if e.kind == "d2h"], engine)
