"""AdamW(decay="matrices"): two param groups as nanoGPT builds them (>= 2-D parameters decay, biases
and norm gains do not), per-group learning rates under a scheduler; exactly torch.optim.AdamW with
the same two groups (fp32, bitwise_torch)."""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from runtime_models import (HYPER, HetStack, assert_same_training, gpt_batches, het_batches, one_torch_thread,
                            tiny_gpt)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

NO_DECAY_LR = 2.5e-3  # group 1's own peak learning rate, different from group 0's


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _torch_groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": NO_DECAY_LR}]


def _reference(model, batches, clip):
    opt = torch.optim.AdamW(_torch_groups(model), **HYPER)
    sched = _schedule(opt)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, opt


def _engine(model, batches, clip, **options):
    engine = ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=clip,
                     optimizer=ph.AdamW(**HYPER, decay="matrices", bitwise_torch=True), **options)
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [HYPER["weight_decay"], 0.0]
    engine.optimizer.param_groups[1]["lr"] = NO_DECAY_LR
    sched = _schedule(engine.optimizer)
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        losses.append(loss.item())
        engine.step()
        engine.zero_grad()
        sched.step()
    return losses, {n: p.clone() for n, p in engine.master_parameters().items()}, engine


@pytest.mark.parametrize("make,batches", [(tiny_gpt, gpt_batches(5)), (HetStack, het_batches(5))],
                         ids=["gpt", "het"])
@pytest.mark.parametrize("clip", [None, 0.5], ids=["backward-overlap", "clipped"])
@pytest.mark.parametrize("resident", [0, 1], ids=["streamed", "resident-block-0"])
def test_two_groups_train_exactly_like_torch_adamw(make, batches, clip, resident):
    """Streamed blocks (host Adam per group) and a device-resident block (device AdamW per group)."""
    torch.manual_seed(0)
    model = make()
    ref_model = copy.deepcopy(model)
    ref_losses, ref_params, ref_opt = _reference(ref_model, batches, clip)
    losses, params, engine = _engine(model, batches, clip, resident_blocks=resident)
    try:
        assert_same_training((ref_losses, ref_params), (losses, params, engine))
        assert [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in ref_opt.param_groups]
        # the state dict is torch's for the same two groups, and loads back
        got, want = engine.optimizer.state_dict(), ref_opt.state_dict()
        assert [{k: v for k, v in g.items() if k != "initial_lr"} for g in got["param_groups"]] == \
            [{k: v for k, v in g.items() if k != "initial_lr"} for g in want["param_groups"]]
        assert got["state"].keys() == want["state"].keys()
        for i, st in want["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(got["state"][i][key], st[key], rtol=1e-6, atol=1e-7)
        engine.optimizer.load_state_dict(want)
        one_group = copy.deepcopy(want)
        one_group["param_groups"] = one_group["param_groups"][:1]
        with pytest.raises(ValueError, match="expected 2 param group"):
            engine.optimizer.load_state_dict(one_group)
    finally:
        engine.close()


def test_decayed_parameters_are_matrices_and_embeddings():
    model = tiny_gpt(layers=2)
    shapes = {id(p): p.dim() for p in model.parameters()}
    engine = ph.wrap(model, blocks=model.blocks, window=1, optimizer=ph.AdamW(decay="matrices"))
    decayed, plain = engine.optimizer.param_groups
    assert decayed["params"] and all(shapes[id(p)] >= 2 for p in decayed["params"])
    assert plain["params"] and all(shapes[id(p)] == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(shapes)
    engine.close()


def test_bf16_groups_update_like_one_group_when_nothing_decays():
    """The per-group host path (slices of the flat buffers, bf16 shadows) gives the one-call result."""
    results = []
    for decay in ("all", "matrices"):
        torch.manual_seed(0)
        model = tiny_gpt(layers=3)
        engine = ph.wrap(model, blocks=model.blocks, window=1, precision="bf16",
                         optimizer=ph.AdamW(lr=1e-3, weight_decay=0.0, decay=decay))
        losses = []
        for x, y in gpt_batches(3):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        results.append((losses, engine.master_parameters()))
        engine.close()
    assert results[0][0] == results[1][0]
    for name, p in results[0][1].items():
        assert torch.equal(p, results[1][1][name]), name


def test_decay_must_be_known():
    with pytest.raises(ValueError, match="AdamW.decay"):
        ph.AdamW(decay="norms")
