"""layer_drop=p: seeded per-step block skipping; a skipped block is neither loaded nor updated, and
training equals plain PyTorch skipping the same blocks."""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.streaming.layer_drop import LayerDrop
from runtime_models import HYPER, HetStack, het_batches, one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS, P, SEED = 6, 0.4, 7


def reference(model, batches, m, clip, dropped_per_step):
    """Plain PyTorch + torch.optim.AdamW, the dropped blocks replaced by the identity: their ``.grad``
    is None, so AdamW neither updates them nor decays their moments nor advances their step count.
    Returns (losses, parameters, optimizer state dict)."""
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    originals = [b.forward for b in model.blocks]
    losses = []
    for s, dropped in enumerate(dropped_per_step):
        for i, block in enumerate(model.blocks):
            block.forward = (lambda x: x) if i in dropped else originals[i]
        for x, y in batches[s * m:(s + 1) * m]:
            loss = model(x, y)
            (loss / m if m > 1 else loss).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, copy.deepcopy(opt.state_dict())


def train(model, batches, m, *, seed=SEED, **options):
    engine = ph.wrap(model, blocks=model.blocks, optimizer=ph.AdamW(**HYPER, bitwise_torch=True),
                     accumulation_steps=m, layer_drop=P, layer_drop_seed=seed, trace=True, **options)
    losses, active = [], []
    try:
        for s in range(STEPS):
            losses += engine.accumulate(batches[s * m:(s + 1) * m], lambda b: engine(*b)).tolist()
            active.append(engine.layer_drop.active or list(range(engine.n_streamed)))
            engine.step()
            engine.zero_grad()
        engine.synchronize()
        h2d = [e for e in engine.trace.events() if e.kind == "h2d"]
        params = {k: v.clone() for k, v in engine.master_parameters().items()}
        optimizer_state = copy.deepcopy(engine.optimizer.state_dict())
    finally:
        engine.close()
    return losses, params, active, h2d, optimizer_state


@pytest.mark.parametrize("schedule, m, clip", [("default", 1, None), ("relay", 2, None), ("relay", 3, 0.05),
                                               ("default", 2, 0.05)])
def test_layer_drop_equals_pytorch_skipping_the_same_blocks(schedule, m, clip):
    model = HetStack()
    n = len(model.blocks)
    batches = het_batches(STEPS * m)
    losses, params, active, h2d, optimizer_state = train(copy.deepcopy(model), batches, m, schedule=schedule, window=2,
                                        clip_grad_norm=clip, strict=True)
    dropped = [set(range(n)) - set(a) for a in active]
    assert any(dropped) and not all(len(d) == 0 for d in dropped), "the seed drops some blocks"
    draws = LayerDrop(n, P, SEED)  # the same draws from the same seed
    for a in active:
        draws.draw_if_new_step()
        assert (draws.active or list(range(n))) == a
        draws.end_step()
    ref_losses, ref_params, ref_state = reference(model, batches, m, clip, dropped)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-6, atol=1e-7, msg=name)
    # a block's AdamW step counts the steps it ran (per-block counts, as torch's per parameter)
    names = [name for name, _ in model.named_parameters()]
    assert optimizer_state["state"].keys() == ref_state["state"].keys()
    for index, st in ref_state["state"].items():
        assert float(optimizer_state["state"][index]["step"]) == float(st["step"]), names[index]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer_state["state"][index][key], st[key], rtol=1e-6, atol=1e-9,
                                       msg=f"{names[index]} {key}")
    assert len({float(st["step"]) for st in ref_state["state"].values()}) > 1, "some block skipped a step"
    # skipped blocks are never loaded: per step, each running block once in forward, and in
    # backward those not among the last W (relay: for all m micro-batches at once)
    loads_per_step = [len(a) + max(0, len(a) - 2) for a in active]
    assert len(h2d) == sum(loads_per_step) * (1 if schedule == "relay" else m) + \
        (0 if schedule == "relay" else sum(len(a) for a in active) * (m - 1))  # + accumulation uploads
    assert {e.block for e in h2d} <= set(range(n))


def test_layer_drop_is_reproducible_and_seeded():
    model = HetStack()
    batches = het_batches(STEPS)
    a = train(copy.deepcopy(model), batches, 1, window=2)
    b = train(copy.deepcopy(model), batches, 1, window=2)
    c = train(copy.deepcopy(model), batches, 1, window=2, seed=SEED + 1)
    assert a[0] == b[0] and a[2] == b[2]
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
    assert a[2] != c[2]


def test_layer_drop_bad_input():
    model = HetStack()
    with pytest.raises(ValueError, match="layer_drop"):
        ph.wrap(model, blocks=model.blocks, layer_drop=1.0)
    with pytest.raises(ValueError, match="resident_blocks"):
        ph.wrap(model, blocks=model.blocks, layer_drop=0.1, resident_blocks=1)


def test_per_block_step_counts_round_trip_through_the_optimizer_state_dict():
    """A state dict with different step counts per block (layer drop) loads back as it was: each block's
    count, the engine's steps the largest; a block's parameters with two counts are refused."""
    model = HetStack()
    batches = het_batches(STEPS)
    engine = ph.wrap(copy.deepcopy(model), blocks=None, optimizer=ph.AdamW(**HYPER), layer_drop=P,
                     layer_drop_seed=SEED)
    try:
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
            engine.zero_grad()
        state, block_steps, steps = copy.deepcopy(engine.optimizer.state_dict()), list(engine.block_steps), engine.steps
    finally:
        engine.close()
    assert len(set(block_steps)) > 1 and steps == STEPS
    other = ph.wrap(copy.deepcopy(model), blocks=None, optimizer=ph.AdamW(**HYPER))
    try:
        other.optimizer.load_state_dict(state)
        assert (list(other.block_steps), other.steps) == (block_steps, steps)
        uneven = copy.deepcopy(state)
        names = [name for name, _ in model.named_parameters()]
        first = names.index("blocks.0.ln.weight")
        uneven["state"][first]["step"] = uneven["state"][first]["step"] + 1
        with pytest.raises(ValueError, match="block 0 must all have AdamW state with one step count"):
            other.optimizer.load_state_dict(uneven)
    finally:
        other.close()
