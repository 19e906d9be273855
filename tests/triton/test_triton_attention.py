"""Flash attention Triton kernels against the explicit math reference (interpreter on CPU)."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402
from pystronghold.kernels import attention as attn  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 `tl.dot` is exact in the interpreter but TF32 on a GPU (TRITON_CPU.md): 1e-2 there.
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-2, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CANARY = -77.0
# TRITON_CPU.md's fast shapes, with the ragged one at H=1 (B*H = 2 still offsets a second head; the
# interpreter's cost is per program). The ragged non-causal case runs in fp32 only: the dtype paths are
# the same code as in the causal ragged case.
RAGGED = (2, 1, 100, 32)
CASES = [(shape, causal, dtype) for shape, causal in [((1, 2, 128, 64), True), ((1, 2, 128, 64), False),
                                                      (RAGGED, True), ((1, 1, 16, 16), True)]
         for dtype in TOL] + [(RAGGED, False, torch.float32)]


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.setenv(dispatch.ENV, "triton")  # on a GPU too: these tests are the kernels' own


def _qkv(shape, dtype):
    return [torch.randn(shape, device=DEVICE).to(dtype).requires_grad_() for _ in range(3)]


def _check_fwd_bwd(shape, causal, dtype, softmax_scale=None):
    q, k, v = _qkv(shape, dtype)
    o = PF.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert o.shape == q.shape and o.dtype == dtype
    do = torch.randn_like(o)
    o.backward(do)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o_ref = attn.attention_math_reference(*ref, causal=causal, softmax_scale=softmax_scale)
    o_ref.backward(do.float())
    tol = TOL[dtype]
    torch.testing.assert_close(o.float(), o_ref, atol=tol, rtol=tol)
    for name, t, r in zip("qkv", (q, k, v), ref):
        torch.testing.assert_close(t.grad.float(), r.grad, atol=tol, rtol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("shape,causal,dtype", CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_attention_matches_reference(shape, causal, dtype):
    _check_fwd_bwd(shape, causal, dtype)


def test_attention_non_power_of_two_head_dim_and_scale():
    _check_fwd_bwd((1, 1, 40, 80), True, torch.float32, softmax_scale=0.3)


def test_attention_saves_log_sum_exp():
    # "ieee": exact fp32 products on a GPU too (the default TF32 put the LSE 1.6e-3 off on an H100).
    q, k, v = (t.detach() for t in _qkv((1, 2, 100, 32), torch.float32))
    scale = 1 / math.sqrt(32)
    _, lse = attn.attention_fwd(q, k, v, True, scale, input_precision="ieee")
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(100, 100, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).reshape(2, 100), atol=1e-5, rtol=1e-5)


def test_attention_ieee_precision_matches_fp32_reference():
    """fp32 with input_precision="ieee" holds fp32 tolerances on a GPU as in the interpreter (the
    default TF32 needs 1e-2 there, TOL). 1e-4, not 1e-5: a GPU's exp2 is approximate (about 2 ulp)
    and sums in another order, through backward's longer chains."""
    q, k, v = _qkv((1, 2, 100, 32), torch.float32)
    o = attn.attention(q, k, v, causal=True, input_precision="ieee")
    do = torch.randn_like(o)
    o.backward(do)
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    o_ref = attn.attention_math_reference(*ref, causal=True)
    o_ref.backward(do)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    for name, t, r in zip("qkv", (q, k, v), ref):
        torch.testing.assert_close(t.grad, r.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_attention_rejects_unknown_input_precision():
    q, k, v = (torch.randn(1, 1, 16, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="input_precision must be one of"):
        attn.attention(q, k, v, input_precision="tf32x3")
    with pytest.raises(ValueError, match="input_precision must be one of"):
        attn.attention_fwd(q, k, v, True, 0.25, input_precision="fp32")


def test_attention_canaries_untouched():
    shape, pad = (1, 2, 100, 32), 53
    n = math.prod(shape)
    q, k, v = (t.detach() for t in _qkv(shape, torch.float16))
    bufs = [torch.full((n + 2 * pad,), CANARY, dtype=q.dtype, device=DEVICE) for _ in range(4)]
    views = [b[pad:pad + n].view(shape) for b in bufs]
    o, lse = attn.attention_fwd(q, k, v, True, 0.2, o=views[0])
    attn.attention_bwd(torch.randn_like(q), q, k, v, o, lse, True, 0.2, grads=views[1:])
    for b in bufs:
        assert (b[:pad] == CANARY).all() and (b[-pad:] == CANARY).all()
        assert torch.isfinite(b).all()


def test_attention_bad_inputs():
    q, k, v = (torch.randn(1, 1, 32, 8, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="head dim"):
        PF.attention(q, k, v)
    big = torch.randn(1, 1, 16, 256, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        PF.attention(big, big, big)
    q = torch.randn(1, 1, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        PF.attention(q, q[:, :, :16], q)
    with pytest.raises(ValueError, match="share a dtype"):
        PF.attention(q, q.half(), q)
    with pytest.raises(ValueError, match="dtype"):
        PF.attention(q.double(), q.double(), q.double())


def test_attention_takes_the_gpt_layout():
    """q, k, v as a GPT block makes them, (B, N, H, D).transpose(1, 2): non-contiguous inputs are copied."""
    q, k, v = (torch.randn(2, 16, 2, 16, device=DEVICE).transpose(1, 2).requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    o = PF.attention(q, k, v, causal=True)
    o.sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_ref = attn.attention_math_reference(*ref, causal=True)
    o_ref.sum().backward()
    torch.testing.assert_close(o, o_ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    for t, r in zip((q, k, v), ref):
        torch.testing.assert_close(t.grad, r.grad, atol=TOL[torch.float32], rtol=TOL[torch.float32])
