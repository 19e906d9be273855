"""A position-wise module over tiles of the sequence (``nn.tiled``, GPT ``mlp_tile_tokens``): the
output and input gradient of the untiled module bit for bit in fp32 (up to 8K tokens), its parameter
gradients within 1e-6 (bf16: one rounding); through the engine and under TP the same losses; dropout
inside a tile repeats in its recompute; the recompute runs under the forward's autocast; and the
tiled backward never makes a tensor as large as the (B, T, F) intermediate."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.models.gpt import MLP
from pystronghold.nn.tiled import mlp_tile_tokens, tiled
from pystronghold.parallel import init_parallel
from _dist import run_ranks
from runtime_models import HYPER, one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _mlp(tile, hidden=64, seq=300, dtype=torch.float32):
    torch.manual_seed(1)
    return MLP(GPTConfig(vocab_size=10, seq_len=seq, layers=1, hidden=hidden, heads=4,
                         mlp_tile_tokens=tile)).to(dtype)


def _grads(module, x, g):
    y = module(x)
    return y, torch.autograd.grad(y, [x, *module.parameters()], g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,seq,tile", [(2, 256, 64), (1, 300, 128), (3, 200, 48), (1, 8192, 1024)])
def test_the_tiled_gpt_mlp_is_the_untiled_one(dtype, batch, seq, tile):
    whole, tiles = _mlp(0, dtype=dtype), _mlp(tile, dtype=dtype)
    x = torch.randn(batch, seq, 64, dtype=dtype, requires_grad=True)
    g = torch.randn(batch, seq, 64, dtype=dtype)
    want_y, want = _grads(whole, x, g)
    got_y, got = _grads(tiles, x, g)
    assert torch.equal(got_y, want_y)  # each position's matmuls as without tiles
    assert torch.equal(got[0], want[0])
    for name, a, b in zip([n for n, _ in whole.named_parameters()], got[1:], want[1:]):
        # NOTE: a parameter's gradient is a sum over tiles, in another order than one matmul's; in
        # bf16 it is rounded once from the fp32 sum, as one matmul rounds it, but the parts differ
        assert a.dtype == b.dtype and _rel(a, b) <= (1e-6 if dtype == torch.float32 else 1e-2), name


def test_the_untiled_path_is_untouched():
    """mlp_tile_tokens 0, or a tile at least T long, is the module's own forward: no Function."""
    x = torch.randn(2, 64, 64, requires_grad=True)
    for tile in (0, 64, 100):
        assert "Tiled" not in type(_mlp(tile)(x).grad_fn).__name__
    assert "Tiled" in type(_mlp(63)(x).grad_fn).__name__


class _Dropped(torch.nn.Module):
    """Position-wise with dropout between its two matmuls."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(F.dropout(F.gelu(self.up(x)), p=0.5, training=True))


def test_dropout_inside_a_tile_repeats_in_its_recompute():
    """The reference runs the same tiles with a graph: the same masks in the forward; the tiled
    backward must recompute each tile under the RNG state its forward had."""
    module = _Dropped()
    x = torch.randn(2, 50, 16, requires_grad=True)
    g = torch.randn(2, 50, 16)
    torch.manual_seed(7)
    want_y = torch.cat([module(x[:, s:s + 16]) for s in range(0, 50, 16)], dim=1)
    want = torch.autograd.grad(want_y, [x, *module.parameters()], g)
    after_want = torch.rand(3)
    torch.manual_seed(7)
    got_y = tiled(module, x, list(module.parameters()), 16)
    torch.manual_seed(123)  # backward runs under another RNG state: the recompute must not use it
    got = torch.autograd.grad(got_y, [x, *module.parameters()], g)
    assert torch.equal(got_y, want_y)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert _rel(a, b) <= 1e-6
    torch.manual_seed(7)
    tiled(module, x, list(module.parameters()), 16).backward(g)
    assert torch.equal(torch.rand(3), after_want)  # the recompute leaves the caller's RNG where it was


def test_the_recompute_runs_under_the_forwards_autocast():
    """The AMP recipe: the forward under autocast, the backward after it closed. Input gradients are
    the untiled module's bit for bit only if each tile's recompute is in bf16 again."""
    whole, tiles = _mlp(0), _mlp(50)
    x = torch.randn(2, 200, 64, requires_grad=True)
    g = torch.randn(2, 200, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_y, got_y = whole(x), tiles(x)
    assert got_y.dtype == want_y.dtype and torch.equal(got_y, want_y)
    want = torch.autograd.grad(want_y, [x, *whole.parameters()], g)
    got = torch.autograd.grad(got_y, [x, *tiles.parameters()], g)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == torch.float32 and _rel(a, b) <= 1e-2


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("tile", [0, 128])
def test_the_tiled_backward_never_holds_the_whole_intermediate(tile):
    mlp = _mlp(tile, hidden=32, seq=2048)
    x = torch.randn(2, 2048, 32, requires_grad=True)
    intermediate = 2 * 2048 * 4 * 32  # B * T * F
    y = mlp(x)
    with _LargestTensor() as seen:
        y.backward(torch.ones_like(y))
    if tile:  # the (B, T, C) input gradient is the largest
        assert seen.numel <= intermediate // 4
    else:  # the check sees the intermediate when it is made
        assert seen.numel >= intermediate


def test_bad_functions_are_one_line():
    x = torch.randn(1, 40, 8)
    with pytest.raises(ValueError, match="returned tuple, not one tensor"):
        tiled(lambda t: (t, t), x, [], 16)
    with pytest.raises(ValueError, match="is not position-wise"):
        tiled(lambda t: t.sum(1, keepdim=True), x, [], 16)
    with pytest.raises(ValueError, match="GPTConfig.mlp_tile_tokens must be an int >= 0"):
        GPTConfig(vocab_size=10, seq_len=8, layers=1, hidden=8, heads=2, mlp_tile_tokens=-1)


def test_tile_size_from_the_intermediate_budget():
    assert mlp_tile_tokens(1, 8192, 14336, 2) == 0  # 224 MiB: fits 256 MiB
    assert mlp_tile_tokens(1, 32768, 14336, 2) == 9344  # 9362 positions fit, a multiple of 64
    assert mlp_tile_tokens(4, 32768, 14336, 2, budget_bytes=4 * 14336 * 2 * 10) == 10
    with pytest.raises(ValueError, match="batch must be a positive int"):
        mlp_tile_tokens(0, 10, 10, 2)


# ---- through the engine

def _train(model, batches, engine_config):
    engine = ph.wrap(model, blocks=model.blocks, optimizer=ph.AdamW(**HYPER, bitwise_torch=True), **engine_config)
    try:
        losses = []
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        engine.close()


@pytest.mark.parametrize("engine_config", [dict(window=1), dict(window=2, checkpointing=False),
                                           dict(window=2, accumulation_steps=1, clip_grad_norm=0.5)])
def test_the_engine_trains_a_tiled_gpt_to_the_untiled_losses(engine_config):
    """The tiled MLP inside the engine's recompute (or its kept graph): its gradients reach the slot
    parameters, and the losses are the untiled model's (the first bit for bit)."""
    cfg = GPTConfig(vocab_size=97, seq_len=96, layers=3, hidden=32, heads=4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 97, (2, 96), generator=g), torch.randint(0, 97, (2, 96), generator=g))
               for _ in range(4)]
    untiled = GPT(cfg, seed=3)
    tiled_model = GPT(dataclasses.replace(cfg, mlp_tile_tokens=40), seed=3)
    want = _train(untiled, batches, engine_config)
    got = _train(tiled_model, batches, engine_config)
    assert got[0] == want[0]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (got, want)
    assert got[-1] < got[0]  # it trains


def test_a_tiled_gpt_under_plain_pytorch_fills_grad():
    cfg = dict(vocab_size=97, seq_len=64, layers=2, hidden=32, heads=4)
    x = torch.randint(0, 97, (2, 64))
    want, got = GPT(GPTConfig(**cfg), seed=2), GPT(GPTConfig(**cfg, mlp_tile_tokens=20), seed=2)
    want(x, x).backward()
    got(x, x).backward()
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert a.grad is not None and _rel(a.grad, b.grad) <= 1e-6, name


def _tp2_tiled_equals_untiled(rank: int, world: int) -> None:
    group = init_parallel(tp_size=2, heads=4).tp_group
    cfg = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=64, layers=2, hidden=32, heads=4, tp_size=2)
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    want, got = GPT(cfg, seed=7, tp_group=group), GPT(dataclasses.replace(cfg, mlp_tile_tokens=24), seed=7,
                                                      tp_group=group)
    want_loss, got_loss = want(x, x), got(x, x)
    want_loss.backward()
    got_loss.backward()
    assert torch.equal(got_loss, want_loss)
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert _rel(a.grad, b.grad) <= 1e-6, name


def test_tensor_parallel_tiles_equal_the_untiled_mlp():
    """Under TP each tile's fc2 all-reduces in forward and fc1's input gradient in backward: every
    rank runs the same tiles, so the collectives pair up."""
    run_ranks(_tp2_tiled_equals_untiled, 2)
