"""The loss over chunks of tokens (``nn.chunked_loss``, GPT ``Tail.loss_chunk_tokens``): the same loss
and gradients as the full logits (fp32 within 1e-6 relative; bf16 input gradients as close, the head's
own gradients within one bf16 rounding), and no tensor as large as the full logits is ever made."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pystronghold.models import GPT, GPTConfig
from pystronghold.nn.chunked_loss import chunked_head_loss, loss_chunk_tokens

CFG = GPTConfig(vocab_size=4000, seq_len=128, layers=2, hidden=32, heads=4)


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CFG.vocab_size, (2, 128), generator=g)
    y = torch.randint(0, CFG.vocab_size, (2, 128), generator=g)
    y[0, :40] = -100
    return x, y


def _loss_and_grads(model, chunk, x, y):
    model.zero_grad()
    model.tail.loss_chunk_tokens = chunk
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpt_loss_over_chunks_equals_the_full_logits_loss(dtype):
    x, y = _batch()
    model = GPT(CFG, seed=1).to(dtype)
    full, ref = _loss_and_grads(model, 0, x, y)
    chunked, got = _loss_and_grads(copy.deepcopy(model), 48, x, y)  # 256 tokens: 6 chunks, the last short
    assert abs(chunked.item() - full.item()) <= 1e-6 * abs(full.item())
    for name in ref:
        head = name.startswith("tail.")
        # NOTE: bf16: the head's gradient is the sum of 6 rounded chunk products, not one rounded matmul
        tol = 1e-6 if dtype == torch.float32 or not head else 1e-2
        assert _rel(got[name], ref[name]) <= tol, name


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 32])
def test_no_tensor_as_large_as_the_full_logits_is_made(chunk):
    x, y = _batch()
    model = GPT(CFG, seed=1)
    model.tail.loss_chunk_tokens = chunk
    full_logits = x.numel() * CFG.padded_vocab_size
    with _LargestTensor() as seen:
        model(x, y).backward()
    if chunk:
        assert seen.numel <= full_logits // 4
    else:  # the check sees the full logits when they are made
        assert seen.numel >= full_logits


def test_no_counted_target_gives_zero_and_a_second_backward_is_refused():
    x, y = _batch()
    model = GPT(CFG, seed=1)
    model.tail.loss_chunk_tokens = 64
    loss = model(x, torch.full_like(y, -100))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.tail.parameters())
    hidden = torch.randn(300, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    twice = chunked_head_loss(hidden, torch.randint(0, 50, (300,)), head,
                              lambda logits, t: torch.nn.functional.cross_entropy(logits, t, reduction="sum"),
                              list(head.parameters()), 100)
    twice.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        twice.backward()


def test_eval_computes_the_loss_without_gradients():
    x, y = _batch()
    model = GPT(CFG, seed=1)
    with torch.no_grad():
        full = model(x, y)
        model.tail.loss_chunk_tokens = 50
        chunked = model(x, y)
    assert not chunked.requires_grad and abs(chunked.item() - full.item()) <= 1e-6 * full.item()


def test_chunk_size_from_the_logits_budget():
    assert loss_chunk_tokens(32_000) == 2048
    assert loss_chunk_tokens(128_256) == 512
    assert loss_chunk_tokens(50_000, budget_bytes=4 * 50_000 * 10) == 10
    with pytest.raises(ValueError, match="must be positive"):
        loss_chunk_tokens(0)


def test_fp16_gradients_under_a_loss_scale_are_as_good_as_the_full_logits_ones():
    """fp16 at 8K tokens with a loss scale of 1024: against the fp32 gradients, the chunked loss's
    input gradients err at most 1.5x as much as the full logits' (a mean's gradient taken per chunk
    before the scale arrives would underflow)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(8192, 32, generator=g)
    targets = torch.randint(0, 4000, (8192,), generator=g)
    head = torch.nn.Linear(32, 4000, bias=False)

    def grad(dtype, chunk):
        h = hidden.to(dtype).detach().requires_grad_()
        w = head.weight.detach().to(dtype).requires_grad_()
        ce = lambda logits, t: torch.nn.functional.cross_entropy(logits.float(), t, reduction="sum")  # noqa: E731
        loss = chunked_head_loss(h, targets, lambda x: x @ w.t(), ce, [w], chunk, divisor=float(targets.numel()))
        (loss * 1024).backward()
        return h.grad.float() / 1024

    want = grad(torch.float32, 1 << 20)
    full, chunked = grad(torch.float16, 1 << 20), grad(torch.float16, 1000)
    assert _rel(chunked, want) <= 1.5 * _rel(full, want)
