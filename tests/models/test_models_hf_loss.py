"""The Hugging Face loss over chunks (``models.hf_loss``): for every family the project tests, the base
model's hidden states through the family's LM head and logit transform, chunk by chunk, give the loss
and gradients of the model's own full logits (fp32, within 1e-6 relative for the loss and 1e-5 for
every gradient); a family whose transform is not known takes the full logits."""

from __future__ import annotations

import copy

import pytest
import torch

from pystronghold.models.hf_loss import HEAD_TRANSFORMS, causal_lm_loss, chunked_causal_lm_loss, lm_head_of
from hf_models import FAMILIES, VOCAB, _config

TRANSFORMED = {"gemma2": ("final_logit_softcapping", 3.0), "gemma3_text": ("final_logit_softcapping", 3.0),
               "cohere": ("logit_scale", 0.7), "granite": ("logits_scaling", 2.5)}
"""Families whose logits are transformed, with a value far from the default so a missed transform shows."""


def _model(family):
    pytest.importorskip("transformers")
    config, make = _config(family)
    if family in TRANSFORMED:
        setattr(config, *TRANSFORMED[family])
    torch.manual_seed(0)
    return make(config).eval()  # eval: no dropout, so both losses see the same function


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_chunked_loss_equals_the_full_logits_loss(family):
    model = _model(family)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, 60), generator=g)
    y = torch.randint(0, VOCAB, (2, 60), generator=g)
    y[1, :7] = -100
    full_model, chunked_model = copy.deepcopy(model), copy.deepcopy(model)
    full = causal_lm_loss(full_model(input_ids=x, use_cache=False).logits, y)
    full.backward()
    chunked = chunked_causal_lm_loss(_call, chunked_model, x, y, 16)  # 120 tokens: 8 chunks
    chunked.backward()
    assert abs(chunked.item() - full.item()) <= 1e-6 * abs(full.item())
    for (name, a), b in zip(full_model.named_parameters(), chunked_model.parameters()):
        if a.grad is not None:
            assert ((b.grad - a.grad).norm() <= 1e-5 * a.grad.norm()).item(), name


def test_every_tested_family_is_chunked_and_an_unknown_one_takes_the_full_logits(monkeypatch):
    assert set(FAMILIES) <= set(HEAD_TRANSFORMS)
    model = _model("llama")
    assert lm_head_of(model) is not None
    monkeypatch.delitem(HEAD_TRANSFORMS, "llama")
    assert lm_head_of(model) is None
    calls = []

    def run(fn, *args, **kwargs):
        calls.append(fn)
        return fn(*args, **kwargs)

    x = torch.randint(0, VOCAB, (1, 20))
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: seen.append(k) or forward(*a, **k))
    chunked_causal_lm_loss(run, model, x, x, 4)
    assert len(calls) == 1 and len(seen) == 1  # the whole model, with its logits
