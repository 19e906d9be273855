"""bf16 and fp16 through the window runtime against PyTorch's mixed-precision recipe.

Reference: fp32 master copies of the fp32 model's parameters updated by torch.optim.AdamW, the
model cast to bf16/fp16 computing with them (rewritten from the masters after each step); fp16 adds
torch.amp.GradScaler (dynamic loss scale, inf/NaN steps skipped). Stated tolerance: losses to
2e-3 relative and fp32 masters to 1e-4 absolute (one AdamW step at lr=1e-3 moves a weight by
~1e-3, so a missing, doubled or unscaled update fails). It covers the fused host Adam's last-bit
differences flipping a rounding of the half-precision copy; with the same arithmetic the runs
agree bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from runtime_models import HYPER, gpt_batches, one_torch_thread, tiny_gpt, train_engine

_threads = pytest.fixture(autouse=True)(one_torch_thread)

LOSS_RTOL, PARAM_ATOL = 2e-3, 1e-4


def train_mixed_reference(model, batches, dtype, *, clip=None, init_scale=2.0**16):
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    model = model.to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(masters, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if dtype == torch.float16 else None
    losses, skipped = [], 0
    for x, y in batches:
        loss = model(x, y)
        (scaler.scale(loss) if scaler else loss).backward()
        losses.append(loss.item())
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        if scaler:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    names = [n for n, _ in model.named_parameters()]
    return losses, dict(zip(names, [m.detach() for m in masters])), skipped


def _compare(ref, got):
    ref_losses, ref_params = ref[0], ref[1]
    losses, params = got[0], got[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("precision,window", [("bf16", 1), ("bf16", 3), ("fp16", 2)])
def test_half_precision_matches_the_mixed_precision_recipe(precision, window):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model, batches = tiny_gpt(), gpt_batches(20)
    ref = train_mixed_reference(copy.deepcopy(model), batches, dtype)
    got = train_engine(model, batches, window=window, precision=precision, strict=True)
    _compare(ref, got)
    assert all(p.dtype == dtype for p in model.parameters())  # head, tail and block placeholders


def test_bf16_with_clipping():
    model, batches = tiny_gpt(), gpt_batches(12)
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.bfloat16, clip=0.5)
    got = train_engine(model, batches, window=2, precision="bf16", clip_grad_norm=0.5)
    _compare(ref, got)


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
    _compare(ref, got)
