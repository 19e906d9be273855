"""The engine's gradient norms for clipping, from either place (runtime/optimizer/grad_norms.py): from the
slot before the copy-out (the CUDA path, forced here on the CPU backend) or from the host copy
after it; both train exactly like plain PyTorch with clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch

from runtime_models import assert_same_training, gpt_batches, run_both, tiny_gpt


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("on_device", [False, True])
def test_clipping_with_either_norm_path_matches_clip_grad_norm(on_device, one_thread):
    """The engine with its norms taken from the slot before the copy-out (the CUDA path, forced on
    the CPU backend) or on the host after it: plain PyTorch's clipped training, W=2 and K=2."""
    taken = []  # the path each block's norms came from

    def hook(engine):
        norms = engine.grad_norms
        norms.on_device = on_device
        before, after = norms.before_copy_out, norms.after_copy_out
        norms.before_copy_out = lambda b, g, s: (taken.append("device") if norms.on_device else None,
                                                  before(b, g, s))
        norms.after_copy_out = lambda b, h, s: (taken.append("host") if not norms.on_device else None,
                                                 after(b, h, s))

    ref, got = run_both(tiny_gpt, gpt_batches(8), window=2, clip=0.5, resident_blocks=2, strict=True,
                        engine_hook=hook)
    assert_same_training(ref, got)
    assert taken and set(taken) == {"device" if on_device else "host"}
    assert got[2].grad_norm is not None and got[2].grad_norm > 0.5  # clipping was active
