"""A Hugging Face model as the planner costs it: ``pystronghold plan --model hf:DIR``.

Only ``DIR/config.json`` is read (no weights): the model is built by transformers on the ``meta``
device with one block (0 bytes), and the planner takes the names and shapes of its parameters
from it, so they are those of the model ``pystronghold train --model hf:DIR`` trains, for every
architecture ``models.hf.SUPPORTED`` takes, and LoRA targets and --freeze patterns match the
names PEFT and the runtime see. Tensor parallelism is 1 (as the runtime trains Hugging Face models).
"""

from __future__ import annotations

from dataclasses import dataclass

from pystronghold.models.hf import HF_PREFIX, block_stack, read_hf_config

__all__ = ["HFShape", "read_hf_shape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HFShape:
    """The shape of a Hugging Face causal LM: what the planner's formulas read (``GPTConfig``'s
    names where they mean the same) and its parameter tables."""

    source: str
    """The model directory."""
    architecture: str
    """``config.json``'s architecture (a key of ``models.hf.SUPPORTED``)."""
    layers: int
    """Blocks (``num_hidden_layers``)."""
    hidden: int
    """Width C (``hidden_size``)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (fewer than ``heads`` with grouped-query attention)."""
    head_dim: int
    """Width of one head."""
    mlp_width: int
    """MLP width F (``intermediate_size``)."""
    gated_mlp: bool
    """The MLP is gated (SwiGLU: gate and up projections) rather than one GELU layer."""
    seq_len: int
    """Longest sequence the model takes (``max_position_embeddings``), tokens."""
    vocab_size: int
    """Rows of the embedding (Hugging Face does not pad the vocabulary)."""
    tie_embeddings: bool
    """The LM head is the token embedding."""
    fan_in_fan_out: bool
    """Matrix weights are stored (in, out) (GPT-2's ``Conv1D``), not (out, in) as ``nn.Linear``'s."""
    blocks_name: str
    """Dotted path of the block stack (``model.layers``)."""
    block_params: tuple[tuple[str, tuple[int, ...]], ...]
    """(name relative to the block, shape) of one block's parameters, ``named_parameters()`` order."""
    head_tail_params: tuple[tuple[str, tuple[int, ...]], ...]
    """(full name, shape) of every parameter outside the blocks (a tied LM head once)."""
    tp_size: int = 1
    """Tensor-parallel ranks: 1."""

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and LM head (``vocab_size``: not padded)."""
        return self.vocab_size

    @property
    def ffn_hidden(self) -> int:
        """MLP width F (``mlp_width``)."""
        return self.mlp_width


def read_hf_shape(directory: str) -> HFShape:
    """The ``HFShape`` of the Hugging Face model directory ``directory`` (its ``config.json``).
    ValueError with one line when the directory, its config or transformers is missing."""
    from pystronghold.extras import require

    spec = read_hf_config(directory)
    try:
        require("hf", f"--model {HF_PREFIX}DIR")
    except ImportError as e:
        raise ValueError(str(e)) from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(spec.source, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{spec.source}/config.json: transformers cannot read it: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    config.num_hidden_layers = 1  # one block tells every block's shapes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks_name, _ = block_stack(model)
    prefix = f"{blocks_name}.0."
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    block = tuple((name[len(prefix):], shape) for name, shape in named if name.startswith(prefix))
    head_tail = tuple((name, shape) for name, shape in named if not name.startswith(f"{blocks_name}."))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return HFShape(source=spec.source, architecture=spec.architecture, layers=layers, hidden=hidden,
                   heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim,
                   mlp_width=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                   or 4 * hidden,
                   gated_mlp=any(name.endswith("gate_proj.weight") for name, _ in block),
                   seq_len=spec.seq_len, vocab_size=spec.vocab_size,
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()),
                   blocks_name=blocks_name, block_params=block, head_tail_params=head_tail)
