"""A Hugging Face model as the planner costs it: ``pystronghold plan --model hf:DIR``.

Only ``DIR/config.json`` is read: transformers builds one block on ``meta`` and the planner takes
its parameter names and shapes, so they match what ``train --model hf:DIR``, LoRA and --freeze
see. At ``tp_size`` T the tables are one rank's (``params.block_param_shapes``): the projections the
family's ``base_model_tp_plan`` names split as ``models.hf_tp`` splits them (colwise: output rows and
bias; rowwise: input columns), the embedding and LM head over the vocabulary; a T that
``models.hf_tp.check_hf_tp`` refuses is refused here in its words. A MoE block holds every expert
but a token's FLOPs and activations count ``experts_per_token`` of them; block 0 stands for every
block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pystronghold.models.hf import (HF_PREFIX, NO_POSITION_LIMIT, POSITION_KEYS, HFModelConfig, block_stack,
                                    read_hf_config)
from pystronghold.models.hf_tp import HEAD_ROWS, block_tp_styles, check_hf_tp
from pystronghold.models.hf_tp_derive import is_conv1d
from pystronghold.options import first_line
from pystronghold.planner.params import is_expert_param, is_matrix_weight, numel

__all__ = ["HFShape", "read_hf_shape", "hf_shape_from_config"]

_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json's names for the routed experts of a MoE block."""
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
"""... and for the experts each token is routed to (top-k)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFShape:
    """The shape of a Hugging Face causal LM: what the planner's formulas read (``GPTConfig``'s
    names where they mean the same) and its parameter tables."""

    source: str
    """The model directory."""
    architecture: str
    """``config.json``'s architecture."""
    model_type: str
    """``config.json``'s ``model_type`` (``llama``, ``mixtral``, ...)."""
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
    """The MLP (or each expert) is gated (SwiGLU: gate and up projections) rather than one GELU layer."""
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
    experts: int = 0
    """Routed experts of a MoE block (0: a dense MLP)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k; 0: dense)."""
    active_mlp_width: int = 0
    """MLP width one token passes through: F when dense; top-k x an expert's width + the shared
    experts' width in a MoE block (from the weights' shapes)."""
    tp_size: int = 1
    """Tensor-parallel ranks the tables are split over (``params.block_param_shapes`` gives one
    rank's shapes; ``block_params`` and ``head_tail_params`` stay whole)."""
    block_tp_axes: tuple[tuple[str, int], ...] = ()
    """(name relative to the block, axis) of each block parameter tensor parallelism splits: 0 for
    a colwise projection's weight and bias, 1 for a rowwise one's weight (its bias is replicated)."""
    head_tail_tp_axes: tuple[tuple[str, int], ...] = ()
    """(full name, axis) of the head and tail parameters split over the vocabulary (the embedding,
    the LM head and its bias: axis 0)."""
    embedding_params: tuple[str, ...] = ()
    """Full names of the input embedding's parameters: a pipeline's first stage holds them, its last
    stage the other head and tail parameters (and the embedding again when the LM head is tied)."""
    spec: HFModelConfig | None = field(default=None, compare=False, repr=False)
    """The directory's config (what ``models.hf_tp.check_hf_tp`` judges a ``tp_size`` by)."""

    def __post_init__(self) -> None:
        if self.tp_size != 1:
            if self.spec is None:
                raise ValueError(f"{self.source}: the shape was built without its config; it is planned at tp 1 only")
            check_hf_tp(self.spec, self.tp_size)  # train's one-line refusal, word for word

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
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec.source, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{spec.source}/config.json: transformers cannot read it: "
                         f"{first_line(e)}") from None
    return hf_shape_from_config(config, source=spec.source, architecture=spec.architecture)


def _first_set(config, names: tuple[str, ...]) -> int:
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), 0)


def hf_shape_from_config(config, *, source: str, architecture: str) -> HFShape:
    """The ``HFShape`` of the causal LM a transformers ``config`` (a ``PretrainedConfig``, not
    modified) builds (its block stack found by ``models.hf.block_stack``). ValueError (one line) for a MoE config
    that does not say how many experts a token is routed to."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    spec = HFModelConfig(source=source, architecture=architecture, config=config.to_dict())
    config = copy.deepcopy(config)
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_attention_heads
    config.num_hidden_layers = 1  # one block tells every block's shapes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks_name, blocks = block_stack(model)
    prefix = f"{blocks_name}.0."
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    block = tuple((name[len(prefix):], shape) for name, shape in named if name.startswith(prefix))
    head_tail = tuple((name, shape) for name, shape in named if not name.startswith(f"{blocks_name}."))
    gated = any(name.endswith("gate_proj.weight") or "gate_up_proj" in name for name, _ in block)
    mlp_width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    experts = top_k = 0
    active_width = mlp_width
    if any(is_expert_param(name) for name, _ in block):
        experts, top_k = _first_set(config, _EXPERTS), _first_set(config, _EXPERTS_PER_TOKEN)
        if not experts or not top_k:
            raise ValueError(f"{source}/config.json: a mixture-of-experts block, but none of "
                             f"{', '.join(_EXPERTS if not experts else _EXPERTS_PER_TOKEN)} is set")
        matrices = 3 if gated else 2  # an expert's (gate,) up and down projections, each C x F_e

        def width(names) -> int:
            return sum(numel(s) for n, s in block if is_matrix_weight(n, s) and names(n)) // (matrices * hidden)

        active_width = (top_k * width(is_expert_param) // experts
                        + width(lambda n: {"shared_expert", "shared_experts"} & set(n.split("."))))
    block_axes, head_tail_axes = _tp_axes(spec, model, blocks_name, blocks[0])
    return HFShape(source=source, architecture=architecture, layers=layers, hidden=hidden,
                   heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or hidden // heads,
                   mlp_width=mlp_width, gated_mlp=gated,
                   seq_len=_first_set(config, POSITION_KEYS) or NO_POSITION_LIMIT, model_type=config.model_type,
                   vocab_size=config.vocab_size,
                   tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                   fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()),
                   blocks_name=blocks_name, block_params=block, head_tail_params=head_tail,
                   experts=experts, experts_per_token=top_k, active_mlp_width=active_width,
                   block_tp_axes=block_axes, head_tail_tp_axes=head_tail_axes, spec=spec,
                   embedding_params=tuple(f"{_module_name(model, model.get_input_embeddings())}.{n}"
                                          for n, _ in model.get_input_embeddings().named_parameters()))


def _module_name(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _tp_axes(spec: HFModelConfig, model, blocks_name: str, block) -> tuple[tuple, tuple]:
    """(block axes, head and tail axes) as ``HFShape`` keeps them: what ``models.hf_tp`` splits."""
    column, row = {"weight": 0, "bias": 0}, {"weight": 1}
    axes = {"colwise": column, "colwise_gather_output": column, "rowwise": row, "rowwise_split_input": row,
            HEAD_ROWS: {"weight": 0}}
    conv1d_axes = {"colwise": {"weight": 1, "bias": 0}, "rowwise": {"weight": 0}}  # weight (in, out)
    styles = block_tp_styles(spec, blocks_name.split(".")[-1], block)
    block_axes = []
    for name, _ in block.named_parameters():
        module, _, kind = name.rpartition(".")
        split = conv1d_axes if is_conv1d(block.get_submodule(module)) else axes
        axis = split.get(styles.get(module, ""), {}).get(kind)
        if axis is not None:
            block_axes.append((name, axis))
    vocab = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
             for p in m.parameters()}
    head_tail_axes = [(name, 0) for name, p in model.named_parameters()
                      if id(p) in vocab and not name.startswith(f"{blocks_name}.")]
    return tuple(block_axes), tuple(head_tail_axes)
