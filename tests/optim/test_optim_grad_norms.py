"""Per-parameter gradient norms (optim.functional.param_grad_norms): the native multi-threaded host
pass (torch.ops.pystronghold.param_grad_norms) gives torch.linalg.vector_norm's fp32 results bit for
bit, whatever the thread count; the device path is torch._foreach_norm, clip_grad_norm_'s on CUDA."""

from __future__ import annotations

import pytest
import torch

from pystronghold.ops import native_ops
from pystronghold.optim.functional import device_param_grad_norms, param_grad_norms

SIZES = [1, 7, 17, 1023, 2**20 + 3]


def _grads(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # a flat buffer cut into parameter views with shapes, as layout.views() gives them
    flat = (torch.randn(sum(SIZES) + 64, generator=g) * 3).to(dtype)
    views, offset = [], 0
    for n in SIZES:
        views.append(flat[offset:offset + n].view(-1, 1) if n % 2 else flat[offset:offset + n])
        offset += n + 16
    return views


def _reference(grads: list[torch.Tensor], scale: float) -> torch.Tensor:
    """What the host path computed before (and clip_grad_norm_ computes on the CPU), one at a time."""
    return torch.stack([torch.linalg.vector_norm(g.float() * scale if scale != 1.0 else g.float()) for g in grads])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0**-16])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_native_norms_are_torchs_bit_for_bit(dtype, scale, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grads = _grads(dtype)
        got = param_grad_norms(grads, scale)
        expected = _reference(grads, scale)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and got.shape == (len(SIZES),)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_native_norms_do_not_depend_on_the_thread_count():
    grads = _grads(torch.float32, seed=3) * 5  # many parameters: every thread takes several
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            results.append(param_grad_norms(grads, 0.5))
    finally:
        torch.set_num_threads(before)
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_native_norms_keep_inf_and_nan():
    grads = [torch.ones(40000), torch.ones(40000), torch.ones(5)]
    grads[0][123] = float("inf")
    grads[1][7] = float("nan")
    got = param_grad_norms(grads)
    assert got[0] == float("inf") and got[1].isnan() and got[2] == torch.linalg.vector_norm(grads[2])


def test_device_path_logic_on_cpu():
    """The _foreach_norm path (CUDA's) run on CPU tensors: there torch's foreach falls back to one
    vector_norm per tensor, so it must equal the reference bit for bit, scaled or not, any dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        grads = _grads(dtype)
        for scale in (1.0, 0.25):
            assert torch.equal(device_param_grad_norms(grads, scale), _reference(grads, scale))
    assert device_param_grad_norms([]).shape == (0,)


@pytest.mark.parametrize("grads, scale, pattern", [
    ([torch.ones(3, dtype=torch.int32)], 1.0, r"grads\[0\] must be float32, bfloat16 or float16"),
    ([torch.ones(3), torch.ones(3, device="meta")], 1.0, "must be on one device"),
    ([torch.ones(3)], float("inf"), "grad_scale must be finite"),
])
def test_bad_gradients_are_refused_naming_the_problem(grads, scale, pattern):
    with pytest.raises(ValueError, match=pattern):
        param_grad_norms(grads, scale)


def test_meta_grads_are_refused_by_the_native_pass():
    with pytest.raises(ValueError, match=r"grads\[0\] must be on the CPU"):
        native_ops().param_grad_norms([torch.ones(3, device="meta")], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_norms_on_cuda_are_clip_grad_norms():
    """On CUDA: per-parameter norms as clip_grad_norm_ takes them there (torch._foreach_norm)."""
    grads = [g.cuda() for g in _grads(torch.float32)]
    torch.testing.assert_close(param_grad_norms(grads), torch.stack(torch._foreach_norm(grads)), rtol=0, atol=0)
    bf = [g.cuda() for g in _grads(torch.bfloat16)]
    expected = torch.stack([torch._foreach_norm([g.float() * 0.5])[0] for g in bf])
    torch.testing.assert_close(param_grad_norms(bf, 0.5), expected, rtol=0, atol=0)
