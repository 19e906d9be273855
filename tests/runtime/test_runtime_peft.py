"""PEFT models (``peft.get_peft_model``) through ``pystronghold.wrap``: the block stack is found
through PEFT's wrappers, LoRA and ``modules_to_save`` train to plain PyTorch + peft +
torch.optim.AdamW (fp32 bit for bit; bf16 to ``MIXED_LOSS_RTOL``/``MIXED_PARAM_ATOL``), and
``save_pretrained`` after training writes adapters that ``PeftModel.from_pretrained`` reloads to
the trained model. Tiny Hugging Face models from small configs (``hf_small``); nothing downloaded."""

from __future__ import annotations

import copy

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.engine import Engine
from hf_small import MODELS, token_batches
from runtime_models import (assert_same_mixed_training, assert_same_training, one_torch_thread, train_engine,
                            train_mixed_reference, train_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 8

LORA = {
    # q, v and the MLP's down projection
    "llama": dict(target_modules=["q_proj", "v_proj", "down_proj"]),
    # GPT-2's fused qkv and its MLP's down projection (Conv1D: weights stored transposed), with dropout
    "gpt2": dict(target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True, lora_dropout=0.1),
}
SAVED = {"llama": ["lm_head", "post_attention_layernorm"], "gpt2": ["ln_f", "ln_2"]}
"""``modules_to_save`` per model: a head/tail module and a norm inside every block (GPT-2's lm_head
is tied to the embedding, so its final norm instead)."""


def peft_model(kind: str, modules_to_save: bool = False, seed: int = 0):
    """The tiny ``kind`` model with LoRA adapters of rank 4 (alpha 8); B starts random rather than
    zero (``init_lora_weights=False``) so the adapters change the logits from the first step."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **LORA[kind],
                             modules_to_save=SAVED[kind] if modules_to_save else None)
    return peft.get_peft_model(MODELS[kind](), config)


def lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


def logits(model, x):
    """Eval-mode logits (no dropout) of a model or engine; training mode restored."""
    inner = model.model if isinstance(model, Engine) else model
    was = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            return model(input_ids=x).logits
    finally:
        inner.train(was)


@pytest.mark.parametrize("modules_to_save", [False, True])
@pytest.mark.parametrize("kind", sorted(LORA))
def test_lora_trains_to_plain_peft_losses(peft, kind, modules_to_save):
    """W=2 (W=1 with clipping for GPT-2), blocks found through PeftModel -> LoraModel -> the model;
    only the adapters (and the saved modules' copies) train, everything else stays bit for bit."""
    model = peft_model(kind, modules_to_save)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and len(trainable) < len(list(model.parameters()))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = token_batches(STEPS)
    clip = 1.0 if kind == "gpt2" else None
    torch.manual_seed(1234)  # the same dropout masks for both runs
    ref = train_reference(copy.deepcopy(model), batches, clip=clip, loss_of=lm_loss)
    torch.manual_seed(1234)
    got = train_engine(model, batches, loss_of=lm_loss, blocks=None, clip_grad_norm=clip,
                       window=1 if kind == "gpt2" else 2, strict=True)
    stack = model.base_model.model.transformer.h if kind == "gpt2" else model.base_model.model.model.layers
    assert got[2].n_blocks == len(stack)
    assert_same_training(ref, got, rtol=0, atol=0)  # fp32 with bitwise_torch: bit for bit
    changed = {n for n, p in got[1].items() if not torch.equal(p, initial[n])}
    assert changed == trainable


def test_lora_with_every_state_on_the_nvme_tier(peft, tmp_path):
    """The frozen base and the adapters' states on disk behind a cache of 2 blocks, one resident
    block beside: still plain peft's losses and parameters, bit for bit."""
    model = peft_model("llama", modules_to_save=True)
    batches = token_batches(STEPS)
    ref = train_reference(copy.deepcopy(model), batches, loss_of=lm_loss)
    got = train_engine(model, batches, loss_of=lm_loss, blocks=None, window=1, resident_blocks=1,
                       nvme_dir=str(tmp_path / "nvme"), nvme_states="all", nvme_cache_blocks=2)
    assert got[2].placement.spilled
    assert_same_training(ref, got, rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(LORA))
def test_lora_in_bf16_trains_to_pytorch_mixed_precision(peft, kind):
    """bf16 compute, fp32 masters of the adapters only; the frozen base is its value rounded to bf16."""
    model = peft_model(kind, modules_to_save=True)
    batches = token_batches(STEPS)
    torch.manual_seed(1234)
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.bfloat16, loss_of=lm_loss)
    torch.manual_seed(1234)
    got = train_engine(model, batches, loss_of=lm_loss, blocks=None, window=2, precision="bf16")
    assert_same_mixed_training(ref, got)


@pytest.mark.parametrize("modules_to_save", [False, True])
@pytest.mark.parametrize("kind", sorted(LORA))
def test_save_pretrained_after_training_reloads_to_the_trained_model(peft, tmp_path, kind, modules_to_save):
    """``peft_model.save_pretrained`` reads the trained adapters through ``state_dict`` (the
    engine's fp32 masters); ``PeftModel.from_pretrained`` on a fresh copy of the base gives the
    engine's logits exactly."""
    model = peft_model(kind, modules_to_save)
    engine = ph.wrap(model, window=2, optimizer=ph.AdamW(lr=1e-2))
    x = token_batches(1, seed=3)[0]
    try:
        for batch in token_batches(3):
            engine.backward(lm_loss(engine, batch))
            engine.step()
            engine.zero_grad()
        trained = logits(engine, x)
        model.save_pretrained(tmp_path / "adapter")
    finally:
        engine.close()
    torch.manual_seed(0)
    base = MODELS[kind]()  # the same base weights as peft_model's
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded, x), trained, rtol=0, atol=0)
    assert not torch.equal(logits(peft_model(kind, modules_to_save), x), trained)  # training changed it
