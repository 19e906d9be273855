"""Bias+GeLU and bias+dropout+residual Triton kernels (interpreter on CPU, kernels on GPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402
from pystronghold.kernels import bias_dropout_add as bda  # noqa: E402
from pystronghold.kernels import bias_gelu as bg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GRAD_TOL = {**TOL, torch.float16: 3e-3}  # TRITON_CPU.md: fp16 bias-GeLU grads need 3e-3
CANARY = -77.0


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.setenv(dispatch.ENV, "triton")  # on a GPU too: these tests are the kernels' own


# ---- bias + GeLU


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(8, 256), (3, 1000), (2, 3, 17)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_matches_reference(approximate, shape, dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_()
    y = PF.bias_gelu(x, b, approximate)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, br = x.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    y_ref = torch.nn.functional.gelu(xr + br, approximate=approximate)
    y_ref.backward(dy.float())
    tol, gtol = TOL[dtype], GRAD_TOL[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(x.grad.float(), xr.grad, atol=gtol, rtol=gtol)
    # db sums dx over rows: tolerance scaled by the number of rows summed
    rows = x.numel() // shape[-1]
    torch.testing.assert_close(b.grad.float(), br.grad, atol=gtol * rows, rtol=gtol)


def test_bias_gelu_canaries_untouched():
    n, pad = 3 * 1000, 29
    x, b = torch.randn(3, 1000, device=DEVICE), torch.randn(1000, device=DEVICE)
    y_buf = torch.full((n + 2 * pad,), CANARY, device=DEVICE)
    dx_buf = y_buf.clone()
    y = bg.bias_gelu_fwd(x, b, "none", y=y_buf[pad:pad + n].view(3, 1000))
    dx, _ = bg.bias_gelu_bwd(torch.ones_like(x), x, b, "tanh", dx=dx_buf[pad:pad + n].view(3, 1000))
    for buf in (y_buf, dx_buf):
        assert (buf[:pad] == CANARY).all() and (buf[-pad:] == CANARY).all()
    torch.testing.assert_close(y, torch.nn.functional.gelu(x + b), atol=1e-5, rtol=1e-5)


def test_bias_gelu_bad_inputs():
    x, b = torch.randn(4, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    with pytest.raises(ValueError, match="approximate"):
        PF.bias_gelu(x, b, "sigmoid")
    with pytest.raises(ValueError, match="shape"):
        PF.bias_gelu(x, b[:16])
    with pytest.raises(ValueError, match="dtype"):
        PF.bias_gelu(x.to(torch.int32), b.to(torch.int32))


# ---- bias + dropout + residual


def _bda_inputs(shape=(7, 333), dtype=torch.float32):
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], device=DEVICE).to(dtype).requires_grad_()
    r = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    return x, b, r


@pytest.mark.parametrize("dtype", list(TOL))
def test_bias_dropout_add_matches_mask_and_grads(dtype):
    p = 0.3
    x, b, r = _bda_inputs(dtype=dtype)
    y = PF.bias_dropout_add(x, b, r, p=p, training=True, seed=1234)
    dy = torch.randn_like(y)
    y.backward(dy)
    keep = x.grad != 0                                  # the mask the backward regenerated
    assert 0.6 < keep.float().mean().item() < 0.8        # 2331 Bernoulli(0.7) draws: 6+ sigma margin
    z = x.detach().float() + b.detach().float()
    expected = torch.where(keep, z / (1 - p), 0.0) + r.detach().float()
    tol = TOL[dtype]
    torch.testing.assert_close(y.float(), expected, atol=tol * 4, rtol=tol)  # |z/(1-p)| up to ~7
    torch.testing.assert_close(x.grad.float(), torch.where(keep, dy.float() / (1 - p), 0.0), atol=tol, rtol=tol)
    torch.testing.assert_close(r.grad, dy)
    torch.testing.assert_close(b.grad.float(), x.grad.float().sum(0), atol=tol * 7, rtol=tol)


def test_dropout_determinism_and_seeds():
    x, b, r = _bda_inputs()
    y1 = PF.bias_dropout_add(x, b, r, p=0.5, training=True, seed=7)
    y2 = PF.bias_dropout_add(x, b, r, p=0.5, training=True, seed=7)
    y3 = PF.bias_dropout_add(x, b, r, p=0.5, training=True, seed=8)
    assert torch.equal(y1, y2)
    dropped1, dropped3 = y1 == r, y3 == r
    assert not torch.equal(dropped1, dropped3)
    # the offset shifts the Philox stream: element i at offset k keeps iff element i+k at offset 0 does
    shifted = bda.bias_dropout_add_fwd(x.detach(), b.detach(), r.detach(), 0.5, 7, offset=333)
    assert torch.equal((shifted == r).flatten()[:-333], dropped1.flatten()[333:])


def test_dropout_eval_and_no_bias():
    x, b, r = _bda_inputs()
    y = PF.bias_dropout_add(x, b, r, p=0.9, training=False, seed=0)
    torch.testing.assert_close(y, x + b + r)
    y_nb = PF.bias_dropout_add(x, None, r, p=0.0, training=True, seed=0)
    torch.testing.assert_close(y_nb, x + r)


def test_dropout_canaries_untouched():
    x, b, r = (t.detach() for t in _bda_inputs((5, 100)))
    pad, n = 31, 500
    y_buf = torch.full((n + 2 * pad,), CANARY, device=DEVICE)
    dx_buf = y_buf.clone()
    bda.bias_dropout_add_fwd(x, b, r, 0.2, 3, y=y_buf[pad:pad + n].view(5, 100))
    bda.bias_dropout_add_bwd(torch.ones_like(x), 0.2, 3, dx=dx_buf[pad:pad + n].view(5, 100))
    for buf in (y_buf, dx_buf):
        assert (buf[:pad] == CANARY).all() and (buf[-pad:] == CANARY).all()


def test_dropout_bad_inputs():
    x, b, r = _bda_inputs()
    with pytest.raises(ValueError, match="p="):
        PF.bias_dropout_add(x, b, r, p=1.0, training=True, seed=0)
    with pytest.raises(ValueError, match="residual shape"):
        PF.bias_dropout_add(x, b, r[:3], p=0.1, training=True, seed=0)
