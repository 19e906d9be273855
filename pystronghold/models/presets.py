"""Named GPT sizes and analytic parameter counts.

GPT-3 shapes follow Brown et al. 2020 ("Language Models are Few-Shot Learners"), Table 2.1, with
the context of 2048 tokens and the GPT-2 vocabulary of 50257 tokens padded to a multiple of 128
(as Megatron-LM does) so the vocabulary splits across tensor-parallel ranks. Two rows of that table
are not self-consistent and are corrected here: GPT-3 XL (1.3B) lists 24 heads of size 128 for a
width of 2048, which 24 does not divide, so we use 16 heads of 128; GPT-3 13B lists a width of
5140, which its 40 heads do not divide, so we use 5120 (40 x 128).
"""

from __future__ import annotations

from pystronghold.models.gpt import GPTConfig

__all__ = ["PRESETS", "PRESET_LR", "SMALL_MODEL_LR", "recommended_lr", "param_count", "block_param_count",
           "embedding_param_count"]

_GPT2_VOCAB = 50257


def _gpt3(layers: int, hidden: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=_GPT2_VOCAB, vocab_pad_multiple=128, seq_len=2048,
                     layers=layers, hidden=hidden, heads=heads, tie_embeddings=True)


PRESETS: dict[str, GPTConfig] = {
    # test and benchmark sizes
    "tiny": GPTConfig(vocab_size=256, seq_len=64, layers=4, hidden=64, heads=4),
    "mini": GPTConfig(vocab_size=1024, seq_len=128, layers=8, hidden=128, heads=4),
    "small": GPTConfig(vocab_size=4096, seq_len=256, layers=12, hidden=512, heads=8),
    # GPT-2 small (Radford et al. 2019): 124M parameters with the unpadded vocabulary
    "gpt2-124m": GPTConfig(vocab_size=_GPT2_VOCAB, vocab_pad_multiple=128, seq_len=1024,
                           layers=12, hidden=768, heads=12, tie_embeddings=True),
    # GPT-3 family (Brown et al. 2020, Table 2.1)
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
}

SMALL_MODEL_LR = 2e-3
"""Peak AdamW learning rate of the test-size presets (tiny, mini, small) and of the demo: these
models of at most a few tens of millions of parameters train stably and fast at it."""

PRESET_LR: dict[str, float] = {
    "tiny": SMALL_MODEL_LR,
    "mini": SMALL_MODEL_LR,
    "small": SMALL_MODEL_LR,
    # GPT-2 small: the value nanoGPT and GPT-3 Small (same shape) use; GPT-2's paper gives none
    "gpt2-124m": 6.0e-4,
    # Brown et al. 2020, Table 2.1 ("Learning Rate" column)
    "gpt3-125m": 6.0e-4,
    "gpt3-350m": 3.0e-4,
    "gpt3-760m": 2.5e-4,
    "gpt3-1.3b": 2.0e-4,
    "gpt3-2.7b": 1.6e-4,
    "gpt3-6.7b": 1.2e-4,
    "gpt3-13b": 1.0e-4,
    "gpt3-175b": 0.6e-4,
}
"""Published peak learning rate of every preset (AdamW, batch sizes of the paper); what
``pystronghold train --lr`` defaults to."""


def block_param_count(config: GPTConfig, *, per_tp_rank: bool = False) -> int:
    """Parameters of one transformer block: all tensor-parallel ranks together, or with
    ``per_tp_rank`` those one rank holds (split matrices and column biases divided by tp_size;
    norms and row-parallel biases replicated)."""
    C, Fw, b = config.hidden, config.ffn_hidden, int(config.bias)
    tp = config.tp_size if per_tp_rank else 1
    norms = 2 * (C + b * C)  # ln1, ln2 (replicated)
    split = (C * 3 * C + b * 3 * C + C * C) + (C * Fw + b * Fw + Fw * C)  # qkv, proj W, fc1, fc2 W
    replicated_bias = 2 * b * C  # proj and fc2 biases, added after the all-reduce
    return norms + split // tp + replicated_bias


def embedding_param_count(config: GPTConfig) -> int:
    """Parameters of the head: token embedding (padded vocabulary) plus position embedding."""
    return config.padded_vocab_size * config.hidden + config.seq_len * config.hidden


def param_count(config: GPTConfig) -> int:
    """Total distinct parameters of ``GPT(config)`` (a tied LM head counted once), all TP ranks together."""
    C, b = config.hidden, int(config.bias)
    tail = C + b * C + (0 if config.tie_embeddings else config.padded_vocab_size * C)
    return embedding_param_count(config) + config.layers * block_param_count(config) + tail


def recommended_lr(config: GPTConfig) -> float:
    """Peak learning rate for a model that is not a preset (a JSON file without ``"lr"``): the
    GPT-3 preset lr of the largest GPT-3 size (Table 2.1) whose parameter count ``config`` reaches,
    and ``SMALL_MODEL_LR`` below GPT-3 Small (125M): larger models need smaller steps."""
    n = param_count(config)
    lr = SMALL_MODEL_LR
    for name in sorted((k for k in PRESET_LR if k.startswith("gpt3-")), key=lambda k: param_count(PRESETS[k])):
        if n >= param_count(PRESETS[name]):
            lr = PRESET_LR[name]
    return lr
