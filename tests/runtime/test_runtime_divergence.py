"""A diverged run stops with one line (``DivergenceError``) naming the step and what is inf/NaN:
fp16 after skipping at the loss scale's floor or ``max_skipped_steps`` steps in a row, bf16/fp32 at
the first inf/NaN gradient (with clipping and without); and fp16 refuses a step whose backward
did not go through the loss scale (a plain ``loss.backward()``)."""

from __future__ import annotations

import math

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.optimizer.divergence import DivergenceError, check_finite_state
from runtime_models import gpt_batches, one_torch_thread, tiny_gpt, train_engine

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def _train(batches, *, loss_factor: float, **options):
    """``train_engine`` on a 4-block GPT with every loss multiplied by ``loss_factor``; returns the
    error it raised and the engine."""
    engines = []
    with pytest.raises(DivergenceError) as caught:
        train_engine(tiny_gpt(layers=4), batches, window=2, engine_hook=engines.append,
                     loss_of=lambda engine, batch: engine(*batch) * loss_factor, **options)
    return caught.value, engines[0]


def test_fp16_stops_at_an_overflow_with_the_loss_scale_at_its_floor():
    # every gradient overflows fp16 at any scale >= 1: 4 -> 2 -> 1, then an overflow at the floor
    err, engine = _train(gpt_batches(6), loss_factor=1e9, precision="fp16", initial_loss_scale=4.0)
    assert isinstance(err, ph.DivergenceError) and isinstance(err, FloatingPointError)
    assert (err.step, err.skipped_steps, engine.skipped_steps, engine.steps) == (3, 3, 3, 0)
    assert engine.scaler.scale == 1.0
    message = str(err)
    assert len(message.splitlines()) == 1
    assert message.startswith("step 3: 3 steps in a row skipped for inf/NaN fp16 gradients") and "floor, 1" in message
    assert "lower the learning rate" in message


def test_fp16_stops_after_max_skipped_steps_in_a_row():
    # a loss scale of 2**60 overflows for many steps before reaching the floor
    err, engine = _train(gpt_batches(6), loss_factor=1.0, precision="fp16", initial_loss_scale=2.0**60,
                         max_skipped_steps=2)
    assert (err.step, engine.skipped_steps, engine.steps) == (2, 2, 0)
    assert "max_skipped_steps (--max-skipped-steps 2)" in str(err)


def test_fp16_skips_that_recover_do_not_stop_the_run():
    """Overflows that are not in a row (the scale backs off, then steps succeed) never stop a run."""
    batches = gpt_batches(6)
    overflow = batches[0::2]  # steps 1, 3, 5 overflow: 3 skipped, never 2 in a row

    def loss_of(engine, batch):
        return engine(*batch) * (1e9 if any(batch is b for b in overflow) else 1.0)

    _, _, engine = train_engine(tiny_gpt(layers=4), batches, window=2, precision="fp16", max_skipped_steps=2,
                                loss_of=loss_of)
    assert (engine.skipped_steps, engine.steps) == (3, 3)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("clip", [1.0, None])
def test_an_inf_or_nan_gradient_stops_bf16_and_fp32_in_one_line(precision, clip):
    batches = gpt_batches(3)
    nan_at = 2

    def loss_of(engine, batch):
        loss = engine(*batch)
        return loss * math.nan if batch is batches[nan_at - 1] else loss

    engines = []
    with pytest.raises(DivergenceError) as caught:
        train_engine(tiny_gpt(layers=4), batches, window=2, precision=precision, clip_grad_norm=clip,
                     engine_hook=engines.append, loss_of=loss_of)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"step {nan_at}: "), message
    if clip is None:  # each block's host update finds it (backward overlap)
        assert "the gradient of block" in message and "has inf/NaN values" in message
    else:  # the global norm finds it, before any update
        assert "the gradient norm is nan: inf/NaN gradients in" in message and "nothing was updated" in message
        assert engines[0].steps == nan_at - 1
    assert "skip such steps" not in message and "lower the learning rate" in message


def test_plain_loss_backward_under_fp16_is_refused_at_the_step():
    model = tiny_gpt(layers=4)
    engine = ph.wrap(model, blocks=model.blocks, window=2, precision="fp16", accumulation_steps=2)
    try:
        x, y = gpt_batches(1)[0]
        engine.backward(engine(x, y))
        engine(x, y).backward()  # unscaled: its gradients would be shrunk by the loss scale
        with pytest.raises(RuntimeError, match=r"^fp16: 1 of this step's 2 backward passes did not go through "
                                               r"the loss scale .*call engine\.backward\(loss\)"):
            engine.step()
        engine.zero_grad()
        for _ in range(2):  # the scaled way still works after it
            engine.backward(engine(x, y))
        engine.step()
        assert engine.steps + engine.skipped_steps == 1
    finally:
        engine.close()


def test_plain_loss_backward_is_fine_in_bf16():
    model = tiny_gpt(layers=4)
    engine = ph.wrap(model, blocks=model.blocks, window=2, precision="bf16")
    try:
        x, y = gpt_batches(1)[0]
        engine(x, y).backward()
        engine.step()
        assert engine.steps == 1
    finally:
        engine.close()


def test_check_finite_state_names_the_tensor_and_the_value():
    good = {"a": torch.ones(1023), "b": torch.full((7,), 3e38)}  # large finite values do not overflow the check
    check_finite_state(good, step=5, where="checkpoint x")
    for bad, kind in ((math.inf, "inf"), (-math.inf, "inf"), (math.nan, "NaN")):
        t = torch.zeros(17, dtype=torch.bfloat16)
        t[16] = bad
        with pytest.raises(DivergenceError, match=rf"^step 5: not writing checkpoint x: b\.exp_avg_sq holds {kind} "):
            check_finite_state({"a": torch.ones(3), "b.exp_avg_sq": t}, step=5, where="checkpoint x")
