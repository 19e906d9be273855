"""LayerNorm / RMSNorm Triton kernels against the torch reference (interpreter on CPU, kernels on GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when a kernel module is imported (kernels/_config.py):
    # this must precede the kernel imports below. Harmless to other test files on a GPU-less machine.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402
from pystronghold.kernels import norms  # noqa: E402
from pystronghold.nn import LayerNorm, RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ../shared/TRITON_CPU.md: tolerances that held over seeds against an fp32 torch reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOL)
CANARY = -77.0


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.setenv(dispatch.ENV, "triton")  # on a GPU too: these tests are the kernels' own


def _inputs(shape, dtype, bias=True):
    n = shape[-1]
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, device=DEVICE)).to(dtype).requires_grad_()
    b = (0.5 * torch.randn(n, device=DEVICE)).to(dtype).requires_grad_() if bias else None
    return x, w, b


def _ref_grads(fn, tensors, dy):
    leaves = [None if t is None else t.detach().float().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.float())
    return y, [None if t is None else t.grad for t in leaves]


# LayerNorm without bias only changes a constexpr branch: it runs in fp32 only.
NORM_CASES = [(kind, shape, dtype) for kind in ("layer_norm", "rms_norm")
              for shape in [(64, 128), (7, 1000), (1, 1, 1023)] for dtype in DTYPES]
NORM_CASES += [("layer_norm_nobias", shape, torch.float32) for shape in [(64, 128), (7, 1000)]]


@pytest.mark.parametrize("kind,shape,dtype", NORM_CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_norm_fwd_bwd_matches_reference(kind, shape, dtype):
    x, w, b = _inputs(shape, dtype, bias=kind == "layer_norm")
    if kind == "rms_norm":
        fn, ref, args = PF.rms_norm, norms.rms_norm_reference, (x, w)
    else:
        fn, ref, args = PF.layer_norm, norms.layer_norm_reference, (x, w, b)
    y = fn(*args)
    assert y.dtype == dtype and y.shape == x.shape
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, grads_ref = _ref_grads(ref, args, dy)
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), y_ref, atol=tol, rtol=tol)
    for t, g_ref in zip(args, grads_ref):
        if t is not None:
            # dw/db sum over rows: scale the tolerance with the gradient's magnitude
            torch.testing.assert_close(t.grad.float(), g_ref, atol=tol * max(1.0, g_ref.abs().max().item()), rtol=tol)


def test_norm_rows_16k_wide():
    x, w, b = _inputs((3, 16384), torch.float32)
    y = PF.layer_norm(x, w, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref, (gx, gw, gb) = _ref_grads(norms.layer_norm_reference, (x, w, b), dy)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, gx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, gw, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_rms", [False, True])
def test_norm_canaries_untouched(is_rms):
    m, n, pad = 7, 1000, 45
    x, w, b = _inputs((m, n), torch.float16, bias=not is_rms)
    y_buf = torch.full((m * n + 2 * pad,), CANARY, dtype=x.dtype, device=DEVICE)
    dx_buf = y_buf.clone()
    y, (x2d, mean, rstd) = norms.norm_fwd(x.detach(), w.detach(), None if b is None else b.detach(), 1e-5,
                                          is_rms, y=y_buf[pad:pad + m * n].view(m, n))
    dx, _, _ = norms.norm_bwd(torch.randn_like(y), x2d, w.detach(), mean, rstd, not is_rms, is_rms,
                              dx=dx_buf[pad:pad + m * n])
    for buf in (y_buf, dx_buf):
        assert (buf[:pad] == CANARY).all() and (buf[-pad:] == CANARY).all()
    assert y.data_ptr() == y_buf[pad:].data_ptr() and dx.data_ptr() == dx_buf[pad:].data_ptr()
    assert torch.isfinite(y_buf[pad:-pad]).all()


def test_norm_modules_match_torch():
    x = torch.randn(5, 33, device=DEVICE)
    ln, ref = LayerNorm(33).to(DEVICE), torch.nn.LayerNorm(33).to(DEVICE)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
        ref.weight.copy_(ln.weight)
        ref.bias.copy_(ln.bias)
    torch.testing.assert_close(ln(x), ref(x), atol=1e-5, rtol=1e-5)
    rms = RMSNorm(33, eps=1e-6).to(DEVICE)
    torch.testing.assert_close(rms(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), atol=1e-5, rtol=1e-5)
    assert LayerNorm(8, bias=False).bias is None


def test_norm_bad_inputs():
    x, w, b = _inputs((4, 64), torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        PF.layer_norm(x.double(), w.double(), b.double())
    with pytest.raises(ValueError, match="shape"):
        PF.layer_norm(x, w[:32], b)
    with pytest.raises(ValueError, match="out of range"):
        PF.rms_norm(torch.randn(2, 16385, device=DEVICE), torch.ones(16385, device=DEVICE))
    with pytest.raises(ValueError, match="positive"):
        RMSNorm(0)
    with pytest.raises(ValueError, match="last dim"):
        LayerNorm((4, 8))
    assert LayerNorm((8,)).weight.shape == (8,)


def test_norm_non_contiguous_input():
    x = torch.randn(40, 24, device=DEVICE).t().requires_grad_()        # (24, 40), strides (1, 24)
    w, b = torch.randn(40, device=DEVICE), torch.randn(40, device=DEVICE)
    y = PF.layer_norm(x, w, b)
    y.sum().backward()
    xr = x.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(xr, (40,), w, b).sum().backward()
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(xr.detach(), (40,), w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)
