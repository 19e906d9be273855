"""Training through the window runtime gives the losses and parameters of plain PyTorch (fp32)."""

from __future__ import annotations

import pytest
import torch

from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import (HetStack, assert_same_training, gpt_batches, het_batches,
                            one_torch_thread, run_both, tiny_gpt)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 20


@pytest.mark.parametrize("window", [1, 2, 3, "all"])
def test_gpt_fp32_matches_pytorch(window):
    ref, got = run_both(tiny_gpt, gpt_batches(STEPS), window=window, strict=True)
    assert_same_training(ref, got)
    stats = got[2].stats()
    assert stats["steps"] == STEPS
    assert stats["peak_resident"] == (8 if window == "all" else window)


def test_default_fast_adam_stays_close_to_pytorch():
    """Without bitwise_torch the block updates use an IEEE sqrt where CPU torch uses MKL's (1 ulp off
    on some inputs): losses agree to 1e-6 relative and parameters to 1e-4 absolute (0.1 lr) over 20
    steps. The absolute bound is for noise-gradient elements (the attention key bias, true gradient
    zero), where Adam turns rounding into +-lr steps."""
    (ref_losses, ref_params), (losses, masters, engine) = run_both(
        tiny_gpt, gpt_batches(STEPS), window=2, bitwise_torch=False)
    assert not engine_parts_for_tests(engine)["updates"].bitwise_torch
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for name, p in ref_params.items():
        torch.testing.assert_close(masters[name], p, rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("window", [1, 2, 3, "all"])
def test_heterogeneous_blocks_fp32_matches_pytorch(window):
    ref, got = run_both(HetStack, het_batches(STEPS), window=window, strict=True)
    assert_same_training(ref, got)


@pytest.mark.parametrize("overlap", ["backward", "forward", "none"])
def test_overlap_modes_give_the_same_result(overlap):
    ref, got = run_both(HetStack, het_batches(STEPS), window=2, overlap=overlap)
    assert_same_training(ref, got)


def test_lr_scheduler_drives_every_update():
    def sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    ref, got = run_both(HetStack, het_batches(8), window=2, scheduler=sched)
    assert_same_training(ref, got)
    assert got[2].optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 9)
