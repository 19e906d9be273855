"""Dispatch of pystronghold.nn.functional: torch reference on CPU, Triton when forced or on CUDA."""

import importlib
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.kernels import _config, reference  # noqa: E402


def _args():
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    x, b, r = torch.randn(4, 24), torch.randn(24), torch.randn(4, 24)
    return {
        "attention": ("attention", "attention", (q, q, q), {"causal": True}),
        "layer_norm": ("norms", "layer_norm", (x, torch.ones(24), b), {}),
        "rms_norm": ("norms", "rms_norm", (x, torch.ones(24)), {}),
        "bias_gelu": ("bias_gelu", "bias_gelu", (x, b), {}),
        "bias_dropout_add": ("bias_dropout_add", "bias_dropout_add", (x, b, r),
                             {"p": 0.1, "training": True, "seed": 3}),
        "vocab_parallel_cross_entropy": ("cross_entropy", "vocab_parallel_cross_entropy",
                                         (x, torch.tensor([0, 5, -100, 23])), {}),
    }


@pytest.mark.parametrize("op", list(_args()))
def test_cpu_uses_reference_unless_forced(op, monkeypatch):
    module_name, attr, args, kwargs = _args()[op]
    module = importlib.import_module(f"pystronghold.kernels.{module_name}")
    calls = []
    monkeypatch.setattr(module, attr, lambda *a, **k: calls.append(1) or "triton")
    monkeypatch.delenv(PF.FORCE_ENV, raising=False)
    out = getattr(PF, op)(*args, **kwargs)
    assert isinstance(out, torch.Tensor) and not calls
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    assert getattr(PF, op)(*args, **kwargs) == "triton" and calls == [1]


def test_reference_paths_are_correct_and_differentiable(monkeypatch):
    monkeypatch.delenv(PF.FORCE_ENV, raising=False)
    q, k, v = (torch.randn(2, 2, 33, 16, requires_grad=True) for _ in range(3))
    o = PF.attention(q, k, v, causal=True, softmax_scale=0.5)
    o.sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_ref = reference.attention_math_reference(*leaves, causal=True, softmax_scale=0.5)
    o_ref.sum().backward()
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    for t, r in zip((q, k, v), leaves):
        torch.testing.assert_close(t.grad, r.grad, atol=1e-5, rtol=1e-5)
    x, b, res = torch.randn(6, 50), torch.randn(50), torch.randn(6, 50)
    y1 = PF.bias_dropout_add(x, b, res, p=0.4, training=True, seed=11)
    assert torch.equal(y1, PF.bias_dropout_add(x, b, res, p=0.4, training=True, seed=11))
    assert not torch.equal(y1, PF.bias_dropout_add(x, b, res, p=0.4, training=True, seed=12))
    torch.testing.assert_close(PF.bias_dropout_add(x, b, res, p=0.4, training=False, seed=11), x + b + res)
    torch.testing.assert_close(PF.bias_gelu(x, b, "none"), F.gelu(x + b))
    torch.testing.assert_close(PF.rms_norm(x, torch.ones(50)), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_reference_bad_inputs(monkeypatch):
    monkeypatch.delenv(PF.FORCE_ENV, raising=False)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="approximate"):
        PF.bias_gelu(x, torch.zeros(8), "fast")
    with pytest.raises(ValueError, match="p="):
        PF.bias_dropout_add(x, None, x, p=-0.1, training=True, seed=0)


def test_interpreter_is_chosen_when_a_kernel_is_decorated(monkeypatch):
    """TRITON_INTERPRET is read by @triton.jit, not by `import triton`: what matters is import order
    of the kernel modules, and a kernel compiled for a GPU is refused on CPU tensors."""

    def body(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = triton.jit(body)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = triton.jit(body)
    if torch.cuda.is_available():
        pytest.skip("CPU tensors are only refused on a machine where kernels run compiled")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _config.check_runnable(torch.device("cpu"), compiled)
    _config.check_runnable(torch.device("cpu"), interpreted)
    x = torch.zeros(5)
    interpreted[(1,)](x, 5, BLOCK=16)
    assert torch.equal(x, torch.ones(5))


def test_missing_triton_falls_back_with_one_warning(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(PF, "_warned", False)
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    x = torch.randn(3, 8)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        y = PF.layer_norm(x, torch.ones(8), torch.zeros(8))
    torch.testing.assert_close(y, F.layer_norm(x, (8,)))
    assert PF._warned and not PF.triton_available(x)
