"""Long context through the whole runtime, exact against plain PyTorch: 8,192 tokens a sample with
every long-context setting on at once (the loss over chunks, the MLP over tiles, head and tail
trained from host memory, every block's saved input offloaded), for our GPT and Hugging Face
Llama, Qwen2, Gemma 2 and a mixture of experts, with clipping, accumulation and LoRA; fp32 and
bf16. The reference is the same model trained by torch.optim.AdamW on its full logits, untiled.

Tolerances: fp32 losses within 1e-6 relative, parameters within 1e-5 absolute (the chunked loss
and the tiles reorder sums, so a near-zero gradient may round the other way, and AdamW moves such
an element by up to its lr, 1e-3, times a ratio near 0 or 1: within 1e-5 here, while a missing or
doubled update moves many by ~1e-3; offload and head/tail on the host are bit for bit on their own);
bf16 as every mixed-precision test here (``runtime_models.MIXED_LOSS_RTOL``, ``MIXED_PARAM_ATOL``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pystronghold.models.gpt import GPT, GPTConfig
from pystronghold.models.hf_loss import causal_lm_loss, chunked_causal_lm_loss
from pystronghold.models.hf_tiling import tile_mlps
from pystronghold.runtime.engine import engine_parts_for_tests
from hf_models import FAMILIES
from runtime_models import (HYPER, MIXED_LOSS_RTOL, MIXED_PARAM_ATOL, assert_same_training, train_engine,
                            train_mixed_reference, train_reference)

T = 8192
LOSS_CHUNK, MLP_TILE = 1000, 3000  # chunks and tiles that do not divide T: the last ones are short
LONG = dict(offload_block_inputs=True, head_tail_on_host=True)
"""The runtime's long-context settings, both on."""


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _tokens(steps: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, vocab, (1, T + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def _engine_run(model, batches, *, accumulation=1, clip=None, precision="fp32", loss_of, blocks):
    """Train ``model`` through wrap with every long-context setting (``runtime_models.train_engine``);
    returns (losses, {name: fp32 master}, staged input bytes of the last pass)."""
    losses, params, engine = train_engine(model, batches, accumulation=accumulation, loss_of=loss_of, blocks=blocks,
                                          window=1, clip_grad_norm=clip, precision=precision, **LONG)
    assert engine.head_tail_on_host == LONG["head_tail_on_host"]
    staged = (engine_parts_for_tests(engine)["executor"].input_offload or {}).get("staged_bytes", 0)
    return losses, params, staged


# ---- our GPT

def test_gpt_at_8k_with_every_setting_equals_plain_pytorch():
    """fp32, clipping at 0.5, accumulation 2: 4 micro-batches of 8,192 tokens."""
    config = GPTConfig(vocab_size=256, seq_len=T, layers=2, hidden=32, heads=2)
    reference = GPT(config, seed=3)
    ours = GPT(dataclasses.replace(config, mlp_tile_tokens=MLP_TILE), seed=3)
    ours.load_state_dict(reference.state_dict())
    ours.tail.loss_chunk_tokens = LOSS_CHUNK
    batches = _tokens(4, 256)
    ref = train_reference(reference, batches, clip=0.5, accumulation=2)
    losses, params, staged = _engine_run(ours, batches, accumulation=2, clip=0.5,
                                         loss_of=lambda e, b: e(*b), blocks=ours.blocks)
    assert staged == config.layers * T * config.hidden * 4  # every block's input left the device
    assert_same_training(ref, (losses, params, None), rtol=1e-6, atol=1e-5)


# ---- Hugging Face families

def _hf(family: str, **extra):
    transformers = pytest.importorskip("transformers")
    options = {**FAMILIES[family], "num_hidden_layers": 2, "max_position_embeddings": T, **extra}
    config = transformers.AutoConfig.for_model(family, **options)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _hf_loss(model, batch):
    x, y = batch
    return causal_lm_loss(model(input_ids=x).logits, y)


def _blocks(model):
    from pystronghold.models.hf import block_stack

    return block_stack(model)[1]


def _hf_case(model, batches, *, clip, accumulation, precision="fp32"):
    ours = copy.deepcopy(model)
    tiled = tile_mlps(ours, MLP_TILE)
    if precision == "fp32":
        ref = train_reference(model, batches, clip=clip, accumulation=accumulation, loss_of=_hf_loss)
    else:
        ref = train_mixed_reference(model, batches, torch.bfloat16, clip=clip, loss_of=_hf_loss)
    got = _engine_run(ours, batches, accumulation=accumulation, clip=clip, precision=precision,
                      blocks=_blocks(ours),
                      loss_of=lambda e, b: chunked_causal_lm_loss(e.call, e.model, b[0], b[1], LOSS_CHUNK))
    return ref, got, tiled


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe"])
def test_hf_at_8k_with_every_setting_equals_plain_pytorch(family):
    """fp32, clipping at 1.0, accumulation 2 (a mixture of experts' router included; its MLP is
    not tiled, the others' are)."""
    ref, (losses, params, staged), tiled = _hf_case(_hf(family), _tokens(4, 256), clip=1.0, accumulation=2)
    assert tiled == (0 if family == "qwen2_moe" else 2) and staged > 0
    assert_same_training(ref, (losses, params, None), rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_gemma2_at_8k_with_its_soft_caps_equals_plain_pytorch():
    """Gemma 2's final-logit soft-cap, which the chunked loss applies chunk by chunk. Its attention
    soft-cap makes transformers run eager attention (T x T scores, no SDPA for the family), so
    two heads and two steps keep it under a minute on the CPU."""
    model = _hf("gemma2", sliding_window=T, num_attention_heads=2, num_key_value_heads=1)
    assert model.config.final_logit_softcapping and model.config.attn_logit_softcapping
    ref, (losses, params, staged), tiled = _hf_case(model, _tokens(2, 256), clip=1.0, accumulation=1)
    assert tiled == 2 and staged > 0
    assert_same_training(ref, (losses, params, None), rtol=1e-6, atol=1e-5)


@pytest.mark.slow
def test_hf_llama_at_8k_in_bf16_equals_pytorch_mixed_precision():
    """bf16, two steps. Losses within ``MIXED_LOSS_RTOL``. The chunked loss sums the LM head's
    per-chunk bf16 gradients in fp32 where the reference rounds one whole-sequence bf16 product,
    so a few near-zero gradient elements take the other sign and AdamW moves them by up to lr a
    step the other way: every parameter within 2 x lr x steps of the reference, and all but 0.1%
    within ``MIXED_PARAM_ATOL`` (a missing or doubled update moves nearly all by ~lr). With the
    full logits the same run is bit for bit (head/tail on the host and offload change no bits)."""
    steps = 2
    ref, (losses, params, _), _ = _hf_case(_hf("llama"), _tokens(steps, 256), clip=1.0, accumulation=1,
                                           precision="bf16")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=MIXED_LOSS_RTOL, atol=0)
    total = outside = 0
    for name, want in ref[1].items():
        diff = (params[name] - want).abs()
        assert diff.max().item() <= 2 * HYPER["lr"] * steps, name
        total, outside = total + diff.numel(), outside + (diff > MIXED_PARAM_ATOL).sum().item()
    assert outside <= 1e-3 * total, (outside, total)


@pytest.mark.slow
def test_lora_llama_at_8k_with_every_setting_equals_plain_pytorch():
    """PEFT LoRA (q_proj, v_proj; the base frozen) at 8K, fp32, clipping: only adapters train."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_hf("llama"), peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                             target_modules=["q_proj", "v_proj"]))
    ref, (losses, params, _), _ = _hf_case(model, _tokens(2, 256), clip=1.0, accumulation=1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert_same_training(ref, (losses, params, None), rtol=1e-6, atol=1e-5)
