"""The parameters of a model the planner costs, by name and shape, on one tensor-parallel rank.

A model is a ``GPTConfig`` (the shapes follow ``models/gpt.py``'s ``Block``, ``head`` and ``tail``)
or an ``HFShape`` (a Hugging Face model read from its directory, ``planner/hf_shape.py``, which
carries its tables). Names are ``named_parameters()``'s: a block's relative to the block
(``attn.qkv.weight``, ``self_attn.q_proj.weight``), head and tail ones in full (``head.tok.weight``,
``lm_head.weight``); a tied LM head appears once. What trains and what is frozen is decided on
these names (``planner/trainable.py``), and a block's matmul FLOPs on its matrix weights
(``active_matmul_numel``).
"""

from __future__ import annotations

import math
from typing import Protocol

from pystronghold.models.gpt import GPTConfig
from pystronghold.models.presets import param_count

__all__ = ["Shapes", "block_param_shapes", "head_tail_param_shapes", "block_prefix", "model_params", "stage_end_params",
           "ParamTables", "numel", "is_matrix_weight", "is_expert_param", "active_matmul_numel"]

Shapes = list[tuple[str, tuple[int, ...]]]
"""(name, shape) of each parameter, in ``named_parameters()`` order."""


class ParamTables(Protocol):
    """A model that carries its parameter tables (``planner/hf_shape.py``'s ``HFShape``): named so
    here rather than imported, as ``hf_shape`` builds on this module."""

    layers: int
    blocks_name: str
    block_params: tuple[tuple[str, tuple[int, ...]], ...]
    head_tail_params: tuple[tuple[str, tuple[int, ...]], ...]
    tp_size: int
    block_tp_axes: tuple[tuple[str, int], ...]
    head_tail_tp_axes: tuple[tuple[str, int], ...]
    embedding_params: tuple[str, ...]
    tie_embeddings: bool


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of ``shape``."""
    return math.prod(shape)


def is_matrix_weight(name: str, shape: tuple[int, ...]) -> bool:
    """The parameter is a weight a matmul multiplies by: 2 dimensions or more (a MoE block's fused
    experts are (experts, out, in)), not a bias."""
    return len(shape) >= 2 and not name.endswith("bias")


def is_expert_param(name: str) -> bool:
    """The parameter belongs to a MoE block's routed experts: its name has an ``experts`` part
    (``mlp.experts.gate_up_proj``, ``block_sparse_moe.experts.3.w1.weight``; not ``shared_experts``)."""
    return "experts" in name.split(".")


def active_matmul_numel(config: GPTConfig | ParamTables, shapes: Shapes) -> int:
    """Elements of the matrix weights among ``shapes`` (a block's) that one token multiplies by: a
    dense weight's all, the routed experts' ``experts_per_token / experts`` of theirs (a token
    visits top-k of them). A forward costs 2 FLOPs per such element and token."""
    experts, top_k = getattr(config, "experts", 0), getattr(config, "experts_per_token", 0)
    matrices = [(n, numel(s)) for n, s in shapes if is_matrix_weight(n, s)]
    total = sum(k for _, k in matrices)
    if not experts:
        return total
    routed = sum(k for n, k in matrices if is_expert_param(n))
    return total - routed + routed * top_k // experts


def _on_rank(shapes, axes: tuple[tuple[str, int], ...], tp: int) -> Shapes:
    """``shapes`` as one of ``tp`` ranks holds them: each parameter named in ``axes`` split along its axis."""
    split = dict(axes)
    return [(name, shape if name not in split or tp == 1 else
             tuple(n // tp if i == split[name] else n for i, n in enumerate(shape))) for name, shape in shapes]


def block_param_shapes(config: GPTConfig | ParamTables) -> Shapes:
    """(name, shape) of each parameter of one block on one rank, in ``named_parameters()`` order;
    a Hugging Face model's split as its ``block_tp_axes`` say. GPT: ln1, attn.qkv, attn.proj, ln2, mlp.fc1, mlp.fc2 (weight then bias); the QKV/fc1 rows and
    the proj/fc2 columns are split over tp ranks, norms and row-parallel biases replicated."""
    if not isinstance(config, GPTConfig):
        return _on_rank(config.block_params, config.block_tp_axes, config.tp_size)
    C, Fw, t, bias = config.hidden, config.ffn_hidden, config.tp_size, config.bias

    def layer(name: str, weight: tuple[int, ...], b: int) -> Shapes:
        return [(f"{name}.weight", weight)] + ([(f"{name}.bias", (b,))] if bias else [])

    return (layer("ln1", (C,), C) + layer("attn.qkv", (3 * C // t, C), 3 * C // t)
            + layer("attn.proj", (C, C // t), C) + layer("ln2", (C,), C)
            + layer("mlp.fc1", (Fw // t, C), Fw // t) + layer("mlp.fc2", (C, Fw // t), C))


def head_tail_param_shapes(config: GPTConfig | ParamTables) -> Shapes:
    """(full name, shape) of each head and tail parameter on one rank (a Hugging Face model's split
    as its ``head_tail_tp_axes`` say). GPT: token embedding
    (padded vocabulary, split over tp), position embedding, final norm, LM head (absent when tied)."""
    if not isinstance(config, GPTConfig):
        return _on_rank(config.head_tail_params, config.head_tail_tp_axes, config.tp_size)
    C, V, t = config.hidden, config.padded_vocab_size, config.tp_size
    shapes = [("head.tok.weight", (V // t, C)), ("head.pos.weight", (config.seq_len, C)),
              ("tail.ln_f.weight", (C,))] + ([("tail.ln_f.bias", (C,))] if config.bias else [])
    return shapes + ([] if config.tie_embeddings else [("tail.lm_head.weight", (V // t, C))])


def block_prefix(config: GPTConfig | ParamTables, index: int) -> str:
    """The full-name prefix of block ``index``'s parameters (``blocks.3.``, ``model.layers.3.``)."""
    return f"{'blocks' if isinstance(config, GPTConfig) else config.blocks_name}.{index}."


def model_params(config: GPTConfig | ParamTables) -> int:
    """Distinct parameters of the whole model, all tp ranks together (a tied LM head once)."""
    if isinstance(config, GPTConfig):
        return param_count(config)
    return (config.layers * sum(numel(s) for _, s in config.block_params)
            + sum(numel(s) for _, s in config.head_tail_params))


def stage_end_params(config: GPTConfig | ParamTables) -> tuple[int, int]:
    """(first stage's, last stage's) head and tail parameters on one rank of a pipeline: the input
    embedding on the first, the other head and tail parameters on the last, which holds a copy of a
    tied embedding as its LM head (``pipelining/gpt.py``, ``pipelining/hf.py``). GPT: ``head.*``
    (token and position embeddings) on the first."""
    shapes = head_tail_param_shapes(config)
    first_names = ({n for n, _ in shapes if n.startswith("head.")} if isinstance(config, GPTConfig)
                   else set(config.embedding_params))
    first = sum(numel(s) for n, s in shapes if n in first_names)
    tied = ([numel(s) for n, s in shapes if n == "head.tok.weight"] if isinstance(config, GPTConfig)
            else [numel(s) for n, s in shapes if n in first_names and len(s) == 2])
    last = sum(numel(s) for n, s in shapes if n not in first_names) + (sum(tied) if config.tie_embeddings else 0)
    return first, last
