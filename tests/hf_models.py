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


_COMMON = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0)
_SMALL = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=64, **_COMMON)
_MOE = dict(num_experts_per_tok=2, output_router_logits=True)

FAMILIES = {
    "gpt2": dict(n_layer=3, n_embd=32, n_head=4, n_positions=64, **_COMMON),  # tied, Conv1D, dropout 0.1
    "llama": _SMALL,  # GQA, rotary, RMSNorm, SwiGLU; untied lm_head
    "mistral": _SMALL,
    "qwen2": dict(_SMALL, tie_word_embeddings=True),  # attention biases, tied lm_head
    "qwen3": dict(_SMALL, head_dim=8),
    "gemma": dict(_SMALL, head_dim=8),
    "gemma2": dict(_SMALL, head_dim=8),
    "gemma3_text": dict(_SMALL, head_dim=8),
    "phi": _SMALL,
    "phi3": dict(_SMALL, pad_token_id=0),  # its default pad id (32000) is outside the tiny vocabulary
    "gpt_neox": _SMALL,
    "gptj": dict(n_layer=3, n_embd=32, n_head=4, n_positions=64, rotary_dim=4, **_COMMON),
    "opt": dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, ffn_dim=48, word_embed_proj_dim=32,
                max_position_embeddings=64, **_COMMON),
    "falcon": dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, **_COMMON),
    "bloom": dict(n_layer=3, hidden_size=32, n_head=4, **_COMMON),
    "stablelm": _SMALL,
    "olmo": _SMALL,
    "olmo2": _SMALL,
    "granite": _SMALL,
    "starcoder2": _SMALL,
    "gpt_bigcode": dict(n_layer=3, n_embd=32, n_head=4, n_positions=64, **_COMMON),
    "cohere": _SMALL,
    "glm4": dict(_SMALL, head_dim=8, pad_token_id=0),  # its default pad id is outside the tiny vocabulary
    "smollm3": dict(_SMALL, pad_token_id=0),  # its default pad id is outside the tiny vocabulary
    "mixtral": dict(_SMALL, num_local_experts=4, **_MOE),  # saved per expert, built with fused experts
    "qwen2_moe": dict(_SMALL, num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=24, **_MOE),
    "qwen3_moe": dict(_SMALL, num_experts=4, moe_intermediate_size=24, head_dim=8, **_MOE),
    "olmoe": dict(_SMALL, num_experts=4, **_MOE),
}
"""``model_type`` -> tiny config of every causal-LM family the zoo tests load, train and export (each
saves and reloads in transformers 5.23 with equal logits)."""

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

NO_DROPOUT = {"gpt2": dict(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0), "opt": dict(dropout=0.0)}
"""``save_tiny`` overrides that turn off the dropout a family has by default, for tests that compare a
pipeline's losses with one process's (each stage draws its masks from its own random stream)."""


def _config(arch: str, **overrides):
    import transformers as tf

    if arch not in FAMILIES:
        raise ValueError(arch)
    config = tf.AutoConfig.for_model(arch, **{**FAMILIES[arch], **overrides})
    return config, tf.AutoModelForCausalLM.from_config


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


def save_tiny(root: Path, arch: str, *, shard_size: str = "20KB", tokenizer: bool = True, seed: int = 0,
              **overrides) -> Path:
    """Write a random tiny ``arch`` model (sharded safetensors + index) and a tokenizer to
    ``root/arch``; returns the directory. ``overrides``: config fields instead of ``FAMILIES``'."""
    config, cls = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = cls(config)
    directory = root / arch
    model.save_pretrained(str(directory), max_shard_size=shard_size)
    if tokenizer:
        save_tokenizer(directory)
    return directory


def save_tiny_with_text(root: Path, arch: str, **overrides) -> tuple[Path, Path]:
    """``save_tiny(root, arch, **overrides)`` (with its tokenizer) and a text file of ``TEXT`` to train
    on: ``(model directory, text file)``."""
    directory = save_tiny(root, arch, tokenizer=True, **overrides)
    text = root / "text.txt"
    text.write_text("".join(TEXT * 4))
    return directory, text


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


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A chat template without ``{% generation %}`` markers (turns end with ``<eos>`` and a newline)."""

CHAT_TEMPLATE_MARKED = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}"
                        "{% generation %}{{ m['content'] }}<eos>\n{% endgeneration %}"
                        "{% else %}{{ m['content'] }}<eos>\n{% endif %}{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The same text as ``CHAT_TEMPLATE``, with the assistant turns inside ``{% generation %}`` markers."""


def set_chat_template(directory: Path, template: str | None = CHAT_TEMPLATE):
    """Save ``template`` as the chat template of the tokenizer in ``directory``; returns the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tokenizer.chat_template = template
    (Path(directory) / "chat_template.jinja").unlink(missing_ok=True)  # None leaves an earlier one there
    tokenizer.save_pretrained(str(directory))
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
