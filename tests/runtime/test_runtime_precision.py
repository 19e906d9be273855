"""bf16 and fp16 through the window runtime against PyTorch's mixed-precision recipe
(``runtime_models.train_mixed_reference``: fp32 masters updated by torch.optim.AdamW, the model in
bf16/fp16 computing with them; fp16 adds GradScaler). Stated tolerance: ``MIXED_LOSS_RTOL`` (2e-3
relative) on losses and ``MIXED_PARAM_ATOL`` (1e-4 absolute) on fp32 masters, explained there.
"""

from __future__ import annotations

import copy

import pytest
import torch

from runtime_models import (assert_same_mixed_training, gpt_batches, one_torch_thread, tiny_gpt, train_engine,
                            train_mixed_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.mark.parametrize("precision,window", [("bf16", 1), ("bf16", 3), ("fp16", 2)])
def test_half_precision_matches_the_mixed_precision_recipe(precision, window):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model, batches = tiny_gpt(), gpt_batches(20)
    ref = train_mixed_reference(copy.deepcopy(model), batches, dtype)
    got = train_engine(model, batches, window=window, precision=precision, strict=True)
    assert_same_mixed_training(ref, got)
    assert all(p.dtype == dtype for p in model.parameters())  # head, tail and block placeholders


def test_bf16_with_clipping():
    model, batches = tiny_gpt(), gpt_batches(12)
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.bfloat16, clip=0.5)
    got = train_engine(model, batches, window=2, precision="bf16", clip_grad_norm=0.5)
    assert_same_mixed_training(ref, got)


def test_fp16_overflow_skips_the_whole_step():
    """A huge initial loss scale overflows fp16 gradients: those steps change nothing anywhere."""
    model, batches = tiny_gpt(), gpt_batches(12)
    init = 2.0**40
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.float16, init_scale=init)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    first = {}

    def after_first_step(engine):
        inner = engine.run_step

        def step():
            inner()
            if not first:
                first.update(engine.master_parameters())
                first["_skipped"] = engine.skipped_steps

        engine.run_step = step

    got = train_engine(model, batches, window=2, precision="fp16", initial_loss_scale=init,
                       engine_hook=after_first_step)
    assert first["_skipped"] == 1
    for name, p in before.items():  # the skipped step left every block, head and tail untouched
        torch.testing.assert_close(first[name], p, rtol=0, atol=0, msg=name)
    assert got[2].skipped_steps == ref[2] >= 1
    assert_same_mixed_training(ref, got)
