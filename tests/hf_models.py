"""Tiny Hugging Face models and a tokenizer written to a test's tmp directory (not a test file).

Nothing is downloaded: each model is a random small config saved with ``save_pretrained`` (sharded
into several safetensors files), and the tokenizer is a byte-level BPE trained here on a few lines.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 300
"""Model vocabulary; the tokenizer below has fewer entries (281)."""

TEXT = [f"def f{k}(x):\n    return x * {k} + 1  # hello world\n" for k in range(40)]
"""What the tokenizer is trained on (and the tests' data)."""


def _config(arch: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0)
    small = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=48, max_position_embeddings=64, **common)
    if arch == "gpt2":  # tied lm_head, blocks at transformer.h, default dropout 0.1
        return tf.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=64, **common), tf.GPT2LMHeadModel
    if arch == "llama":  # GQA, rotary, RMSNorm, SwiGLU; untied lm_head
        return tf.LlamaConfig(**small), tf.LlamaForCausalLM
    if arch == "mistral":
        return tf.MistralConfig(**small), tf.MistralForCausalLM
    if arch == "qwen2":  # attention biases, tied lm_head
        return tf.Qwen2Config(tie_word_embeddings=True, **small), tf.Qwen2ForCausalLM
    raise ValueError(arch)


ARCHS = ("gpt2", "llama", "mistral", "qwen2")


def save_tokenizer(directory: Path) -> None:
    """A byte-level BPE (any text tokenizes, 281 entries, ``<eos>`` = 0) saved in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=281, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(str(directory))


def save_tiny(root: Path, arch: str, *, shard_size: str = "20KB", tokenizer: bool = True, seed: int = 0) -> Path:
    """Write a random tiny ``arch`` model (sharded safetensors + index) and a tokenizer to
    ``root/arch``; returns the directory."""
    config, cls = _config(arch)
    torch.manual_seed(seed)
    model = cls(config)
    directory = root / arch
    model.save_pretrained(str(directory), max_shard_size=shard_size)
    if tokenizer:
        save_tokenizer(directory)
    return directory


def hf_logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of transformers' own ``from_pretrained(directory)`` (eval mode, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def engine_logits(engine, x: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of a wrapped Hugging Face model (eval mode; training mode restored)."""
    was = engine.model.training
    engine.model.eval()
    try:
        with torch.no_grad():
            return engine(input_ids=x).logits
    finally:
        engine.model.train(was)
