"""The CUDA backend trains exactly like W=all and like plain PyTorch, and strict mode (released
slots poisoned with NaN on the compute stream) shows that every copy is ordered by its events.

The CPU backend's tests cannot show this: on CUDA the loads and copy-outs run on their own streams,
ordered against compute only by events; a missing `wait_event` reads a slot before its load
lands, or poisons it under a running kernel, and the numbers change (NaN, with strict=True).
W=1/2 and W=all run the same kernels on the same values, so their losses are compared bit for bit
(as measured on an H100: ../shared/GPU.md).
"""

import copy

import pytest
import torch

from runtime_models import HetStack, gpt_batches, het_batches, tiny_gpt, train_engine, train_reference

STEPS = 6


def on_cuda(batches):
    return [(x.cuda(), y.cuda()) for x, y in batches]


def train(make_model, batches, **options):
    torch.manual_seed(1234)  # the same dropout masks in every run
    losses, params, _ = train_engine(make_model(), on_cuda(batches), device="cuda", **options)
    return losses, params


def assert_identical(got, ref, what):
    (losses, params), (ref_losses, ref_params) = got, ref
    assert losses == ref_losses, f"{what}: losses {losses} != {ref_losses}"
    assert params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), f"{what}: master {name} differs"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 2])
def test_cuda_window_is_exact_against_w_all(cuda_build, precision, window):
    batches = gpt_batches(STEPS)
    ref = train(tiny_gpt, batches, window="all", precision=precision)
    got = train(tiny_gpt, batches, window=window, precision=precision)
    assert_identical(got, ref, f"W={window} {precision}")


def test_cuda_window_with_clipping_is_exact_against_w_all(cuda_build):
    batches = gpt_batches(STEPS)
    ref = train(tiny_gpt, batches, window="all", precision="bf16", clip_grad_norm=0.5)
    got = train(tiny_gpt, batches, window=2, precision="bf16", clip_grad_norm=0.5)
    assert_identical(got, ref, "W=2 bf16 clip 0.5")


@pytest.mark.parametrize("overlap", ["backward", "forward", "none"])
@pytest.mark.parametrize("window", [1, 2])
def test_cuda_strict_mode_orders_every_copy(cuda_build, overlap, window):
    """Poisoned slots (strict) on the CUDA streams, heterogeneous blocks (slots of different sizes
    reused by different blocks): identical to W=all without poisoning."""
    batches = het_batches(STEPS)
    ref = train(HetStack, batches, window="all")
    got = train(HetStack, batches, window=window, overlap=overlap, strict=True)
    assert all(torch.isfinite(torch.tensor(got[0]))), got[0]
    assert_identical(got, ref, f"strict W={window} overlap={overlap}")


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_cuda_nvme_tier_is_exact_with_strict_mode(cuda_build, tmp_path, overlap):
    """Every state on disk: write-backs wait for the copies' events (the host does not, at
    release), strict mode poisons the slots; identical to W=all in host memory."""
    batches = het_batches(STEPS)
    ref = train(HetStack, batches, window="all")
    got = train(HetStack, batches, window=2, overlap=overlap, strict=True, nvme_dir=str(tmp_path / "nvme"),
                nvme_states="all")
    assert_identical(got, ref, f"NVMe tier overlap={overlap}")


def test_cuda_copies_carry_device_marks_only_when_timed(cuda_build):
    from pystronghold.runtime.backends.backend_cuda import CUDABackend
    from pystronghold.runtime.tracing.timing import copy_marks

    backend = CUDABackend("cuda", 1 << 20)
    try:
        dst = backend.device_buffer("x", 1023, torch.float32)
        src = torch.arange(1023.0).pin_memory()
        untimed = backend.h2d(dst, src)
        timed = backend.d2h(torch.empty_like(src).pin_memory(), dst, after=[untimed], timed=True)
        timed.wait()
        assert untimed.done() and copy_marks(untimed) is None
        start, end = copy_marks(timed)
        assert start.elapsed_time(end) >= 0
        torch.testing.assert_close(dst.cpu(), src)
    finally:
        backend.close()


def test_cuda_traced_run_is_exact(cuda_build):
    """Timed copies (trace on) change nothing but the trace, which has the copies."""
    batches = het_batches(STEPS)
    ref = train(HetStack, batches, window="all")
    torch.manual_seed(1234)
    losses, params, engine = train_engine(HetStack(), on_cuda(batches), device="cuda", window=2, trace=True)
    assert_identical((losses, params), ref, "traced W=2")
    kinds = {e.kind for e in engine.trace.events()}
    assert {"h2d", "d2h"} <= kinds, kinds


def test_cuda_matches_plain_pytorch_fp32(cuda_build):
    """W=2 on CUDA against plain PyTorch on CUDA (torch.optim.AdamW): fp32 rounding apart (6e-8
    relative measured on an H100); 1e-5 relative on losses, 1e-5 absolute on the masters."""
    batches = gpt_batches(STEPS)
    torch.manual_seed(0)
    model = tiny_gpt()
    ref_model = copy.deepcopy(model).cuda()
    torch.manual_seed(1234)
    ref_losses, ref_params = train_reference(ref_model, on_cuda(batches))
    torch.manual_seed(1234)
    losses, params, _ = train_engine(model, on_cuda(batches), device="cuda", window=2, bitwise_torch=False)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name].float().cpu(), p.float().cpu(), rtol=1e-5, atol=1e-5, msg=name)
