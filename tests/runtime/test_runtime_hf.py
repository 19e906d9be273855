"""Hugging Face models (random weights, small configs, their default settings) train through the
window exactly as in plain PyTorch; blocks that are not pure for recompute are refused or caught."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pystronghold as ph
from hf_small import MODELS, VOCAB, hf_llama, token_batches
from runtime_models import assert_same_training, het_batches, one_torch_thread, run_both, train_engine, train_reference

transformers = pytest.importorskip("transformers")

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 10


def lm_loss(model, x):
    """The causal-LM loss of one batch of token ids (``model``: the Hugging Face model or its engine)."""
    return model(input_ids=x, labels=x).loss


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hf_models_with_default_configs_train_to_plain_pytorch_losses(kind, window, clip, caplog):
    model = MODELS[kind]()
    assert model.config.use_cache  # the default this test is about
    ref_model = copy.deepcopy(model)
    batches = token_batches(STEPS)
    torch.manual_seed(1234)  # GPT-2's default dropout: the same masks for both runs
    ref = train_reference(ref_model, batches, clip=clip, loss_of=lm_loss)
    torch.manual_seed(1234)
    with caplog.at_level("INFO"):
        got = train_engine(model, batches, loss_of=lm_loss, blocks=None, clip_grad_norm=clip, window=window,
                           strict=True)
    assert "use_cache=False" in caplog.text
    stack = model.transformer.h if kind == "gpt2" else model.model.layers
    assert got[2].n_blocks == len(stack)  # found automatically
    assert_same_training(ref, got)  # measured: bit for bit (0 difference) on this CPU


def test_inference_keeps_the_cache_and_explicit_cache_in_training_is_refused():
    model = hf_llama()
    ref = copy.deepcopy(model)
    engine = ph.wrap(model, window=2)
    x = token_batches(1)[0]
    with torch.no_grad():  # no recompute: the cache is harmless and stays on
        out = engine(input_ids=x)
        torch.testing.assert_close(out.logits, ref(input_ids=x).logits, rtol=1e-5, atol=1e-5)
        assert out.past_key_values is not None
    with pytest.raises(ValueError, match=r"block 0 got a Hugging Face DynamicCache as kwargs\['past_key_values'\]"):
        engine(input_ids=x, labels=x, use_cache=True)
    engine.close()


# ---- blocks that are not pure


class Notes:
    def __init__(self) -> None:
        self.seen: list[int] = []


class NoteTakingBlock(nn.Module):
    """Mutates a non-tensor argument: appends to ``notes`` and scales by how many it has seen."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, notes):
        notes.seen.append(1)
        return x + self.lin(x) * len(notes.seen)


class NotesModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.head, self.tail = nn.Linear(10, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([NoteTakingBlock(d) for _ in range(3)])

    def forward(self, x, y):
        notes, h = Notes(), self.head(x)
        for block in self.blocks:
            h = block(h, notes)
        return nn.functional.mse_loss(self.tail(h), y)


def test_a_block_that_mutates_a_non_tensor_argument_is_refused():
    model = NotesModel()
    engine = ph.wrap(model, window=2)
    x, y = het_batches(1)[0]
    with pytest.raises(ValueError, match=r"block 0's non-tensor argument args\[1\] \(Notes\) changed during its forward"):
        engine(x, y)
    engine.close()


def test_a_mutated_non_tensor_argument_passes_without_recompute():
    """checkpointing=False runs each block once: nothing to protect, and it trains as PyTorch."""
    ref, got = run_both(NotesModel, het_batches(4), window=2, checkpointing=False)
    assert_same_training(ref, got)


class CountingBlock(nn.Module):
    """Hidden state: each call scales its output by how often the block has run."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.lin(x) * (1.0 + 0.01 * self.calls)


class CountingModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.head, self.tail = nn.Linear(10, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([nn.Linear(d, d), CountingBlock(d), nn.Linear(d, d)])

    def forward(self, x, y):
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.tail(h), y)


@pytest.mark.parametrize("strict", [True, False])
def test_strict_mode_catches_a_recompute_that_differs_with_the_block_index(strict):
    engine = ph.wrap(CountingModel(), window=2, strict=strict)
    x, y = het_batches(1)[0]
    loss = engine(x, y)
    if strict:
        with pytest.raises(RuntimeError, match=r"strict: block 1's recomputed output 0 differs"):
            engine.backward(loss)
    else:
        engine.backward(loss)  # the silent difference strict mode exists to catch
        engine.step()
    engine.close()


def test_argument_fingerprint_sees_rebinding_appending_and_in_place_writes():
    from pystronghold.runtime.blocks.purity import fingerprint

    notes = Notes()
    notes.scale, notes.buf = float("nan"), torch.zeros(3)
    before = fingerprint(notes)
    assert fingerprint(notes) == before  # unchanged (a NaN attribute included)
    notes.buf.add_(1)  # in-place write into a tensor attribute
    assert fingerprint(notes) != before
    before = fingerprint(notes)
    notes.seen.append(1)
    assert fingerprint(notes) != before
    before = fingerprint(notes)
    notes.buf = torch.zeros(3)  # rebinding
    assert fingerprint(notes) != before


class TupleBlock(nn.Module):
    """Returns ``(hidden, None, None)`` as Hugging Face blocks of transformers 4.x did."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, layer_past=None, use_cache=False):
        return x + torch.tanh(self.lin(x)), None, None


class TupleModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.head, self.tail = nn.Linear(10, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([TupleBlock(d) for _ in range(3)])

    def forward(self, x, y):
        h = self.head(x)
        for block in self.blocks:
            h, present, attn = block(h, None, use_cache=False)
            assert present is None and attn is None
        return nn.functional.mse_loss(self.tail(h), y)


def test_block_outputs_as_tuples_with_none_go_through():
    ref, got = run_both(TupleModel, het_batches(5), window=2, strict=True)
    assert_same_training(ref, got)
