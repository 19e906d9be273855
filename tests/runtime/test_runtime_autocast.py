"""The usual AMP recipe through the engine: the forward under the caller's ``torch.autocast``, the
backward after it has closed. The backward recompute must run under the forward's autocast, or
the gradients belong to another function than the one whose loss was reported."""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from runtime_models import HYPER, gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 3


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def plain(model, batches, m):
    """Plain PyTorch: each micro-batch's forward under autocast, its backward (of loss / m) outside."""
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    losses = []
    for s in range(STEPS):
        for x, y in batches[s * m:(s + 1) * m]:
            with bf16_autocast():
                loss = model(x, y)
            (loss / m if m > 1 else loss).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), {k: v.detach().clone() for k, v in model.named_parameters()}


def windowed(model, batches, m, window, schedule):
    """The engine in fp32: ``engine(x, y)`` under autocast and ``engine.backward`` outside (m = 1), or
    ``engine.accumulate`` outside autocast with the autocast inside the loss function (the relay runs
    micro-batches 1.. on threads of its own)."""
    engine = ph.wrap(model, blocks=model.blocks, window=window, accumulation_steps=m, schedule=schedule,
                     optimizer=ph.AdamW(**HYPER, bitwise_torch=True))

    def loss_of(batch):
        with bf16_autocast():
            return engine(*batch)

    try:
        losses = []
        for s in range(STEPS):
            items = batches[s * m:(s + 1) * m]
            if m == 1:
                loss = loss_of(items[0])
                engine.backward(loss)
                losses.append(loss.detach().reshape(1))
            else:
                losses.append(engine.accumulate(items, loss_of))
            engine.step()
            engine.zero_grad()
        return torch.cat(losses), {k: v.clone() for k, v in engine.master_parameters().items()}
    finally:
        engine.close()


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("schedule,m", [("default", 1), ("relay", 2)])
def test_recompute_runs_under_the_forwards_autocast(window, schedule, m):
    model, batches = tiny_gpt(layers=4), gpt_batches(STEPS * m)
    want = plain(copy.deepcopy(model), batches, m)
    got = windowed(model, batches, m, window, schedule)
    # bit for bit: the same bf16 forward, the same gradients, torch's AdamW
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=0, atol=0, msg=name)


def test_recompute_of_a_forward_without_autocast_runs_without_it():
    """The reverse: a backward under autocast recomputes an fp32 forward in fp32, as plain PyTorch's
    backward (under that autocast) of the kept fp32 graph."""
    model, batches = tiny_gpt(layers=4), gpt_batches(STEPS)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    engine = ph.wrap(model, blocks=model.blocks, window=2, optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    try:
        for x, y in batches:
            want, got = ref(x, y), engine(x, y)
            with bf16_autocast():
                want.backward()
                engine.backward(got)
            opt.step()
            opt.zero_grad()
            engine.step()
            engine.zero_grad()
            assert torch.equal(got, want)
        masters = engine.master_parameters()
    finally:
        engine.close()
    for name, value in ref.named_parameters():
        torch.testing.assert_close(masters[name], value.detach(), rtol=0, atol=0, msg=name)
