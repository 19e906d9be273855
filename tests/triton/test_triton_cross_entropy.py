"""Vocab-parallel cross-entropy: Triton kernels vs F.cross_entropy, on one rank (interpreter on CPU, kernels on
GPU) and on 2 gloo ranks (CPU tensors in the interpreter: CPU machines only)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402
from pystronghold.kernels import cross_entropy as ce  # noqa: E402
from pystronghold.parallel.groups import free_local_port  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# ../shared/TRITON_CPU.md; they hold on a GPU too: the kernels have no tl.dot (no TF32), only fp32 loads and reductions
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
T, V = 32, 1000
CANARY = -77.0


@pytest.fixture(autouse=True)
def triton_on_cpu(monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.setenv(dispatch.ENV, "triton")  # on a GPU too: these tests are the kernels' own


def _targets(vocab_local: int, generator=None, device="cpu"):
    """Random targets plus both sides of every shard boundary and three ignored rows (drawn on CPU)."""
    target = torch.randint(0, V, (T,), generator=generator)
    boundaries = [0, V - 1] + [b + d for b in range(vocab_local, V, vocab_local) for d in (-1, 0)]
    target[1:1 + len(boundaries)] = torch.tensor(boundaries)
    target[[0, 17, T - 1]] = -100
    return target.to(device)


def _compare(logits_full, target, shard_range, dtype, eps, reduction, group=None):
    """Loss and shard gradient of PF.vocab_parallel_cross_entropy vs F.cross_entropy on full logits."""
    lo, hi = shard_range
    shard = logits_full[:, lo:hi].to(dtype).clone().requires_grad_()
    loss = PF.vocab_parallel_cross_entropy(shard, target, group=group, label_smoothing=eps, reduction=reduction)
    full_ref = logits_full.to(dtype).float().clone().requires_grad_()  # dtype-rounded inputs, fp32 math
    ref = F.cross_entropy(full_ref, target, label_smoothing=eps, reduction=reduction)
    device = logits_full.device
    weights = torch.linspace(0.5, 1.5, T, device=device) if reduction == "none" else torch.tensor(1.0, device=device)
    (loss.float() * weights).sum().backward()
    (ref * weights).sum().backward()
    tol = TOL[dtype]
    assert loss.dtype == dtype
    torch.testing.assert_close(loss.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(shard.grad.float(), full_ref.grad[:, lo:hi], atol=tol, rtol=tol)


# ---- one rank: an ordinary fused cross-entropy


# every reduction and smoothing in fp32; two of them in fp16 and bf16 (the dtype only changes loads/stores)
ONE_RANK = [(torch.float32, eps, red) for eps, red in [(0.0, "mean"), (0.1, "mean"), (0.0, "sum"), (0.2, "none")]]
ONE_RANK += [(dt, eps, red) for dt in (torch.float16, torch.bfloat16) for eps, red in [(0.1, "mean"), (0.0, "none")]]


@pytest.mark.parametrize("dtype,eps,reduction", ONE_RANK, ids=str)
def test_cross_entropy_one_rank(eps, reduction, dtype):
    logits = 3 * torch.randn(T, V, device=DEVICE)
    _compare(logits, _targets(V, device=DEVICE), (0, V), dtype, eps, reduction)


def test_cross_entropy_canaries_untouched():
    pad = 41
    logits, target = torch.randn(T, 37, device=DEVICE), torch.randint(0, 37, (T,), device=DEVICE)
    buf = torch.full((T * 37 + 2 * pad,), CANARY, device=DEVICE)
    loss, _, grad = ce.ce_fwd(logits, target, None, -100, 0.0, "mean", True, grad=buf[pad:pad + T * 37].view(T, 37))
    assert (buf[:pad] == CANARY).all() and (buf[-pad:] == CANARY).all()
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction="none"))


def test_cross_entropy_bad_inputs():
    logits, target = torch.randn(4, 10, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="reduction"):
        PF.vocab_parallel_cross_entropy(logits, target, reduction="max")
    with pytest.raises(ValueError, match="expected logits_shard"):
        PF.vocab_parallel_cross_entropy(logits, target[:3])
    with pytest.raises(ValueError, match="dtype"):
        PF.vocab_parallel_cross_entropy(logits.double(), target)
    with pytest.raises(ValueError, match="label_smoothing"):
        PF.vocab_parallel_cross_entropy(logits, target, label_smoothing=1.5)


# ---- two gloo ranks


def _tp_worker(rank: int, world_size: int, port: int):
    os.environ[PF.FORCE_ENV] = "1"
    torch.set_num_threads(1)  # 2 ranks x 2 threads on 2 cores would spin in OpenMP barriers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        gen = torch.Generator().manual_seed(0)                 # same logits and targets on every rank
        logits = 3 * torch.randn(T, V, generator=gen)
        vocab_local = V // world_size
        target = _targets(vocab_local, gen)
        shard = (rank * vocab_local, (rank + 1) * vocab_local)
        # fp16 and the other reductions are covered on one rank; each new case here costs ~1 s
        cases = {"1": [(torch.float32, 0.1, "none"), (torch.bfloat16, 0.0, "mean")],
                 "0": [(torch.float32, 0.1, "none")]}
        for force, path_cases in cases.items():                 # the kernels, then the torch reference
            os.environ[PF.FORCE_ENV] = force
            for dtype, eps, reduction in path_cases:
                _compare(logits, target, shard, dtype, eps, reduction, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors in the interpreter; on CUDA "
                    "the one-rank tests cover the kernels, the CPU run the cross-rank reduction")
def test_vocab_parallel_two_gloo_ranks():
    mp.spawn(_tp_worker, args=(2, free_local_port()), nprocs=2, join=True)
