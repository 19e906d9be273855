"""engine.eval() / engine.train(), and no-grad forwards through the window (validation, generation)."""

from __future__ import annotations

import copy

import torch

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from runtime_models import HYPER, gpt_batches, one_torch_thread

import pytest

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def _dropout_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=97, seq_len=32, layers=4, hidden=64, heads=4, dropout=0.2))


def test_eval_turns_dropout_off_in_every_block_and_train_back_on():
    model = _dropout_gpt()
    ref = copy.deepcopy(model).eval()
    engine = ph.wrap(model, blocks=model.blocks, window=1)  # three of four blocks evicted at any time
    x, y = gpt_batches(1)[0]
    assert engine.eval() is engine and not engine.training
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        first, second = engine(x, y), engine(x, y)
        assert torch.equal(first, second)  # no dropout anywhere
        torch.testing.assert_close(first, ref(x, y), rtol=1e-6, atol=1e-6)
    engine.train()
    assert engine.training and all(m.training for m in model.modules())
    with torch.no_grad():
        assert not torch.equal(engine(x, y), engine(x, y))  # dropout masks differ again
    engine.close()


def test_no_grad_forward_after_training_equals_plain_model_eval():
    """Train a few steps, then validate: the no-grad loss is the plain model's with the same weights,
    and the pass neither recomputes nor copies gradients out."""
    model = _dropout_gpt()
    plain = copy.deepcopy(model)  # its weights are replaced by the engine's after training
    engine = ph.wrap(model, blocks=model.blocks, window=2, trace=True,
                     optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    batches = gpt_batches(4)
    for x, y in batches[:3]:
        engine.backward(engine(x, y))
        engine.step()
        engine.zero_grad()
    engine.synchronize()
    plain.load_state_dict(engine.master_parameters())
    plain.eval()
    engine.trace.clear()
    engine.eval()
    x, y = batches[3]
    with torch.no_grad():
        got = engine(x, y)
        assert not engine.in_pass()
    torch.testing.assert_close(got, plain(x, y), rtol=1e-6, atol=1e-6)
    engine.synchronize()
    kinds = [e.kind for e in engine.trace.events()]
    assert kinds.count("compute_fwd") == 4 and kinds.count("h2d") >= 2  # blocks loaded through the window
    assert not {"recompute", "compute_bwd", "d2h", "optimizer"} & set(kinds)
    engine.train()
    engine.backward(engine(x, y))  # training resumes after validation
    engine.step()
    engine.close()
