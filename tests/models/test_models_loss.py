"""The GPT's loss (`lm_loss`): the vocab-parallel cross-entropy against the gathered F.cross_entropy it
replaced, on one rank and on 2 gloo ranks, on both paths (torch reference and Triton: in the interpreter on
CPU, on CUDA tensors on a GPU machine, where the gloo ranks skip), with padded vocabulary columns and ignored
targets."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_ranks

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.models import GPT, GPTConfig  # noqa: E402
from pystronghold.models.gpt import lm_loss  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU machine compiles the kernels: no CPU tensors
B, T = 2, 16
TOL = dict(atol=1e-5, rtol=1e-5)  # fp32; the kernels' tolerance (TRITON_CPU.md), on a GPU too (no tl.dot)


def _gathered_loss(logits_full, targets, vocab_size):
    """What lm_loss computed before: full logits, padding dropped, F.cross_entropy in fp32."""
    return F.cross_entropy(logits_full[..., :vocab_size].reshape(-1, vocab_size).float(), targets.reshape(-1),
                           ignore_index=-100)


def _case(vocab_size, padded, generator=None):
    """Logits (B, T, padded) with huge padding logits (they would dominate if not masked) and targets
    with ignored positions and both ends of the vocabulary."""
    logits = 3 * torch.randn(B, T, padded, generator=generator)
    logits[..., vocab_size:] = 30.0
    targets = torch.randint(0, vocab_size, (B, T), generator=generator)
    targets[0, :3] = torch.tensor([-100, 0, vocab_size - 1])
    targets[1, -1] = -100
    return logits, targets


def _check(logits_full, targets, vocab_size, lo, hi, group, exact):
    shard = logits_full[..., lo:hi].clone().requires_grad_()
    loss = lm_loss(shard, targets, vocab_size, group)
    loss.backward()
    full = logits_full.clone().requires_grad_()
    ref = _gathered_loss(full, targets, vocab_size)
    ref.backward()
    tol = dict(atol=0, rtol=0) if exact else TOL
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(shard.grad, full.grad[..., lo:hi], **tol)
    assert (shard.grad[..., max(0, vocab_size - lo):] == 0).all()  # padding: no gradient


@pytest.mark.parametrize("path", dispatch.PATHS)
@pytest.mark.parametrize("vocab_size,padded", [(50, 64), (64, 64)])
def test_one_rank_equals_the_gathered_loss(path, vocab_size, padded, monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.setenv(dispatch.ENV, path)
    logits, targets = (t.to(DEVICE) for t in _case(vocab_size, padded))  # drawn on CPU
    # the torch path is the old computation itself (F.cross_entropy on the fp32 real columns): bit-exact
    _check(logits, targets, vocab_size, 0, padded, None, exact=path == "torch")


def test_bf16_logits_give_an_fp32_loss(monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    logits, targets = (t.to(DEVICE) for t in _case(50, 64))
    losses = {}
    for path in dispatch.PATHS:
        monkeypatch.setenv(dispatch.ENV, path)
        losses[path] = lm_loss(logits.bfloat16(), targets, 50, None)
    assert {loss.dtype for loss in losses.values()} == {torch.float32}
    ref = _gathered_loss(logits.bfloat16(), targets, 50)
    torch.testing.assert_close(losses["torch"], ref, atol=0, rtol=0)
    torch.testing.assert_close(losses["triton"], ref, **TOL)  # fp32 math on the same bf16 inputs


def _two_ranks(rank: int, world: int) -> None:
    os.environ[PF.FORCE_ENV] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    group = dist.group.WORLD
    # (vocab, padded): padding on rank 1 only; rank 1 all padding (its local max is -inf)
    for vocab_size, padded in [(50, 64), (30, 64)]:
        logits, targets = _case(vocab_size, padded, torch.Generator().manual_seed(vocab_size))
        targets[1, 0] = padded // 2 - 1 if vocab_size > padded // 2 else targets[1, 0]  # shard boundary
        targets[1, 1] = padded // 2 if vocab_size > padded // 2 else targets[1, 1]
        lo, hi = rank * padded // 2, (rank + 1) * padded // 2
        for path in dispatch.PATHS:
            os.environ[dispatch.ENV] = path
            _check(logits, targets, vocab_size, lo, hi, group, exact=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors in the interpreter; on CUDA "
                    "the one-rank tests cover the kernels, the CPU run the cross-rank reduction")
def test_two_ranks_equal_the_gathered_loss():
    run_ranks(_two_ranks, 2, timeout_s=120.0)


def test_gpt_loss_is_the_loss_of_its_logits():
    cfg = GPTConfig(vocab_size=50, vocab_pad_multiple=32, seq_len=T, layers=1, hidden=32, heads=2)
    model = GPT(cfg, seed=3)
    idx = torch.randint(0, 50, (B, T))
    targets = idx.roll(-1, 1)
    targets[0, 0] = -100
    torch.testing.assert_close(model(idx, targets), _gathered_loss(model(idx), targets, 50), atol=0, rtol=0)


def test_bad_vocab_size_is_refused():
    logits, targets = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    for bad in (0, 11, 2.0):
        with pytest.raises(ValueError, match="vocab_size"):
            PF.vocab_parallel_cross_entropy(logits, targets, vocab_size=bad)
