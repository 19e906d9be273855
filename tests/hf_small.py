"""Small random Hugging Face models built in memory (nothing downloaded), and token batches for them:
models we did not write, shared by the tests that train them through the window."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 97


def hf_gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=5, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_llama() -> nn.Module:
    """GQA (2 key/value heads for 4 query heads), rotary, RMSNorm, SwiGLU."""
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": hf_gpt2, "llama": hf_llama}


def _moe_common() -> dict:
    """Two blocks, 4 experts, 2 per token; the router load-balancing loss on (its default weight):
    transformers collects the router logits with forward hooks on each block's router."""
    return dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                eos_token_id=0, num_experts_per_tok=2, output_router_logits=True)


def hf_mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **_moe_common()))


def hf_qwen3_moe() -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, head_dim=8, **_moe_common())
    return transformers.Qwen3MoeForCausalLM(cfg)


def hf_olmoe() -> nn.Module:
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **_moe_common()))


MOE_MODELS = {"mixtral": hf_mixtral, "qwen3_moe": hf_qwen3_moe, "olmoe": hf_olmoe}


def token_batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(steps)]
