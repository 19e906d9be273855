"""Clipping (forward overlap), gradient accumulation, kept activations, nested block arguments:
each still trains exactly like plain PyTorch (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime_models import (HetStack, assert_same_training, gpt_batches, het_batches,
                            one_torch_thread, run_both, tiny_gpt)

_threads = pytest.fixture(autouse=True)(one_torch_thread)


@pytest.mark.parametrize("overlap", ["auto", "none"])
def test_global_norm_clipping_matches_clip_grad_norm(overlap):
    ref, got = run_both(tiny_gpt, gpt_batches(20), window=2, clip=0.5, overlap=overlap, strict=True)
    assert_same_training(ref, got)
    assert got[2].overlap == ("forward" if overlap == "auto" else "none")


def test_clipping_is_active_in_that_test():
    """The clip threshold above is below the real gradient norm, so clipping changes the result."""
    model = tiny_gpt()
    x, y = gpt_batches(1)[0]
    model(x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert norm > 0.5 * 2


@pytest.mark.parametrize("window", [1, 3])
def test_gradient_accumulation_updates_after_the_last_micro_batch(window):
    ref, got = run_both(HetStack, het_batches(20), window=window, accumulation=4, strict=True)
    assert_same_training(ref, got)
    assert got[2].stats()["steps"] == 5


def test_step_before_the_last_micro_batch_is_refused():
    import pystronghold as ph

    model = HetStack()
    engine = ph.wrap(model, blocks=model.blocks, window=2, accumulation_steps=2)
    x, y = het_batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="accumulation_steps=2"):
        engine.step()
    engine.close()


@pytest.mark.parametrize("window", [1, 2, "all"])
def test_kept_activations_match(window):
    ref, got = run_both(tiny_gpt, gpt_batches(20), window=window, checkpointing=False, strict=True)
    assert_same_training(ref, got)


def test_everything_at_once():
    ref, got = run_both(HetStack, het_batches(20), window=3, clip=0.05, accumulation=2,
                        checkpointing=False, strict=True)
    assert_same_training(ref, got)


# ---- blocks with nested arguments and outputs (as Hugging Face blocks have)


class DictBlock(nn.Module):
    """forward(x, *, mask, scale=float) -> {"x": tensor, "aux": (tensor, str)}."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, *, mask, scale=1.0):
        h = torch.tanh(self.fc(x)) * mask * scale
        return {"x": x + h, "aux": (h.square().mean(), "tag")}


class DictModel(nn.Module):
    def __init__(self, d: int = 12, n: int = 4) -> None:
        super().__init__()
        self.head = nn.Linear(5, d)
        self.blocks = nn.ModuleList(DictBlock(d) for _ in range(n))
        self.tail = nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.head(x)
        mask = (x[..., :1] > 0).float()  # does not require grad
        aux = 0.0
        for i, block in enumerate(self.blocks):
            out = block(h, mask=mask, scale=0.5 + i)
            assert out["aux"][1] == "tag"
            h, aux = out["x"], aux + out["aux"][0]
        return torch.nn.functional.mse_loss(self.tail(h), y) + 0.1 * aux


def test_nested_arguments_and_outputs():
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(3, 5, generator=g), torch.randn(3, 1, generator=g)) for _ in range(10)]
    ref, got = run_both(DictModel, batches, window=2, strict=True)
    assert_same_training(ref, got)


def test_inference_forward_under_no_grad_between_steps():
    import pystronghold as ph

    model = tiny_gpt()
    ref = copy.deepcopy(model)
    engine = ph.wrap(model, blocks=model.blocks, window=2)
    x, y = gpt_batches(1)[0]
    with torch.no_grad():
        logits = engine(x)
        torch.testing.assert_close(logits, ref(x), rtol=1e-6, atol=1e-6)
    engine.backward(engine(x, y))  # training continues normally after an inference pass
    engine.step()
    engine.close()


def test_plain_loss_backward_and_optimizer_calls_work_too():
    """loss.backward() (no engine.backward) and engine.optimizer.step()/zero_grad() drive the engine."""
    import pystronghold as ph
    from runtime_models import HYPER, train_reference

    model, batches = HetStack(), het_batches(6)
    ref = train_reference(copy.deepcopy(model), batches)
    engine = ph.wrap(model, blocks=model.blocks, window=2, optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        losses.append(loss.item())
    assert_same_training(ref, (losses, engine.master_parameters(), engine))
    engine.close()


@pytest.mark.parametrize("checkpointing", [True, False])
def test_dropout_masks_repeat_exactly_in_recompute(checkpointing):
    """The recompute restores each block's RNG state, and leaves the global RNG stream untouched."""
    from pystronghold.models import GPT, GPTConfig

    def make():
        return GPT(GPTConfig(vocab_size=97, seq_len=32, layers=4, hidden=64, heads=4, dropout=0.1))

    ref, got = run_both(make, gpt_batches(6), window=1, checkpointing=checkpointing, strict=True)
    assert_same_training(ref, got)
