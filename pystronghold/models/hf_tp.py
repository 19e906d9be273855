"""Tensor parallelism for a Hugging Face causal LM loaded by ``models.hf.load_lazy`` (Megatron's split).

Which projections split is transformers' own ``base_model_tp_plan`` of the family's config class
(``layers.*.self_attn.q_proj: colwise``, ...): a ``colwise`` ``nn.Linear`` becomes a
``ColumnParallelLinear`` (its output features, so whole attention heads or MLP columns, split), a
``rowwise`` one a ``RowParallelLinear`` (its input features split, partial sums all-reduced, the bias
added once after). The embedding becomes a ``VocabParallelEmbedding`` and the LM head a column-parallel
layer over the vocabulary, whose logits shards go to the vocabulary-parallel cross-entropy
(``models.hf_loss``). Each rank holds its shard as a plain tensor tagged ``tp_split``, so the window
store, the host AdamW, checkpoints and the gradient norm treat it as they treat our GPT's. The
attention (and the MLP) enters the tensor-parallel region once, on its input, so q, k and v (gate and
up) share one all-reduce of their input gradients, as our GPT's fused QKV does.

Attention needs no head count changed: transformers' attention modules view their projections as
``(..., -1, head_dim)`` and keep only the ratio of query to key/value heads, which a split by whole
heads keeps. A mixture of experts splits every expert (``models.hf_tp_experts``), and Qwen2-MoE's
shared expert as a dense MLP. Per-head norms (Qwen3's ``q_norm``, ``replicated_with_grad_allreduce``)
stay whole on every rank, their gradients summed over the ranks. A packed projection (Phi-3's
``qkv_proj``, ``colwise_gather_output``) gathers its output, which then runs whole on every rank.
A family without a plan in transformers has one written in ``models.hf_tp_derive``. Families are split
only once tested (``TP_FAMILIES``); the others are refused in one line.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.models.hf import HF_PREFIX, HFModelConfig, LazyHFModel, block_stack, meta_model
from pystronghold.models.hf_loss import HEAD_TRANSFORMS
from pystronghold.models.hf_tp_derive import (DERIVED_DIVIDED, DERIVED_PLANS, PACKED_PARTS,
                                              ColumnParallelConv1D, RowParallelConv1D, check_block_roles,
                                              derived_tp_plan, is_conv1d, localize_heads, undivided)
from pystronghold.models.hf_tp_experts import EXPERTS_STYLES, shard_experts
from pystronghold.options import ConfigError
from pystronghold.parallel.groups import group_size
from pystronghold.parallel.mappings import all_reduce, copy_to_tp_region
from pystronghold.parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                          mark_tp_split, tp_shard_parameter)

__all__ = ["TP_FAMILIES", "TP_STYLES", "hf_tp_plan", "check_hf_tp", "block_tp_styles", "shard_hf_model",
           "ScaledVocabParallelEmbedding", "GRAD_SUMMED", "HEAD_ROWS"]

TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
"""The ``base_model_tp_plan`` styles of linear layers sharded here. ``colwise_gather_output``: the
output rows split, then gathered whole on every rank (a packed ``qkv_proj`` or ``gate_up_proj``, whose
parts the module slices by their full sizes, or q/k/v normed across all heads); what reads it then
runs whole on every rank, and the ``rowwise_split_input`` layer after it takes its ranks' columns."""

GRAD_SUMMED = "replicated_with_grad_allreduce"
"""The plan style of a module kept whole on every rank whose parameters' gradients are summed over
the TP ranks (Qwen3's per-head ``q_norm``/``k_norm``: each rank's gradient covers its heads only)."""

HEAD_ROWS = "split_head_rows"
"""The plan style of a norm whose weight holds a row per head, (heads, head_dim) (Cohere's ``q_norm``
and ``k_norm``), applied to the heads' outputs: each rank keeps its heads' rows (``tp_split`` on dim 0)."""

TP_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gpt_neox", "qwen2_moe", "mixtral", "phi", "olmo",
               "granite", "starcoder2", "cohere", "smollm3", "qwen3", "gemma3_text", "qwen3_moe", "phi3", "glm4",
               "olmo2", "olmoe", "gptj", "opt", "stablelm", "gpt2", "gpt_bigcode", "falcon",
               "bloom")
"""The ``model_type``s split by ``--tp``, each tested against one process (``tests/train/test_train_hf_tp.py``).
NOTE: a plan of the right styles is not enough: a family may hold per-head weights outside it
(StableLM's optional per-head norms: ``_PER_HEAD_NORMS``) whose gradients would then be partial sums."""

_PER_HEAD_NORMS = {"stablelm": "qk_layernorm"}
"""``model_type`` -> the config.json flag that adds per-head q/k norms outside the family's plan: their
gradients would be one rank's heads only, so ``check_hf_tp`` refuses the flag set. NOTE: StableLM's
are a ``ModuleList`` of a norm per head, whose names a rank's part would renumber."""

_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout")
"""config.json's names of the dropout of attention probabilities: on heads split over the ranks, each
rank would draw the masks of its heads from the one stream every rank shares, not one process's."""

_DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "moe_intermediate_size",
            "shared_expert_intermediate_size")
"""config.json's sizes that each rank must hold an equal part of."""


def hf_tp_plan(spec: HFModelConfig) -> dict[str, str]:
    """The family's ``base_model_tp_plan`` (module pattern relative to the base model -> style) as the
    installed transformers declares it on the config class of ``spec``'s ``model_type``, else the plan
    written for it in ``models.hf_tp_derive`` ({} for none)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # NOTE: indexed, not .get(): the lazy mapping's get() does not import the family's module
    config_class = CONFIG_MAPPING[spec.model_type] if spec.model_type in CONFIG_MAPPING else None
    plan = dict(getattr(config_class, "base_model_tp_plan", None) or {})
    if not plan:
        return derived_tp_plan(spec.model_type, spec.config)
    return {**plan, **_SPLIT_BESIDES.get(spec.model_type, {})}


_SPLIT_BESIDES = {"phi": {"layers.*.self_attn.q_layernorm": GRAD_SUMMED,
                          "layers.*.self_attn.k_layernorm": GRAD_SUMMED},
                  "cohere": {"layers.*.self_attn.q_norm": HEAD_ROWS, "layers.*.self_attn.k_norm": HEAD_ROWS},
                  "qwen2_moe": {"layers.*.mlp.shared_expert.gate_proj": "colwise",
                                "layers.*.mlp.shared_expert.up_proj": "colwise",
                                "layers.*.mlp.shared_expert.down_proj": "rowwise",
                                "layers.*.mlp.experts": "moe_tp_experts",
                                "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                "layers.*.mlp.experts.down_proj": "rowwise"}}
"""Modules split here that transformers' plan leaves whole: Phi's optional ``q_layernorm``/``k_layernorm``
(``qk_layernorm``: one LayerNorm over head_dim shared by every head, its gradient summed over the ranks),
Cohere's optional ``q_norm``/``k_norm`` (``use_qk_norm``: a weight row per head), Qwen2-MoE's shared
expert (a dense MLP), and its experts, which the plan of transformers 5.17 (the GPU machine's) does not list though its
experts are the packed ones of the later plans."""


def check_hf_tp(spec: HFModelConfig, tp: int) -> None:
    """ValueError (one line) unless ``--tp tp`` can split the model of ``spec``: its family has a
    tensor-parallel plan of the styles sharded here (``TP_STYLES``), known logits (``HEAD_TRANSFORMS``:
    the loss is vocabulary-parallel), each of its head counts, MLP width and vocabulary divides by
    ``tp``, its attention drops no probabilities, and a plan written in ``models.hf_tp_derive`` names
    every linear layer of its blocks (one block built on meta). Local work on config.json: every rank
    raises the same line."""
    if tp == 1:
        return
    where = f"--tp {tp}: --model {HF_PREFIX}{spec.source} ({spec.model_type})"
    if spec.model_type not in TP_FAMILIES:
        raise ConfigError(f"{where}: tensor parallelism splits only {', '.join(TP_FAMILIES)} models so far; "
                          "train it with --tp 1 (--dp splits the batch instead)")
    plan = hf_tp_plan(spec)
    if not plan:
        raise ConfigError(f"{where}: transformers declares no tensor-parallel plan (base_model_tp_plan) for "
                          "this family; train it with --tp 1")
    other = sorted(f"{key}: {style}" for key, style in plan.items()
                   if style not in (*TP_STYLES, GRAD_SUMMED, HEAD_ROWS)
                   and EXPERTS_STYLES.get(key.partition("mlp.")[2]) != style)
    if other:
        raise ConfigError(f"{where}: its tensor-parallel plan has {other[0]}, which pystronghold does not shard "
                          f"yet (only {', '.join(TP_STYLES)} linear layers); train it with --tp 1")
    if spec.model_type not in HEAD_TRANSFORMS:
        raise ConfigError(f"{where}: its logits' transform is not known here, so the loss cannot be "
                          "vocabulary-parallel; train it with --tp 1")
    flag = _PER_HEAD_NORMS.get(spec.model_type)
    if flag and spec.config.get(flag):
        raise ConfigError(f"{where}: {flag}=true adds per-head q/k norms that pystronghold does not split yet; "
                          "train it with --tp 1")
    whole = undivided(spec.model_type, spec.config) if spec.model_type in DERIVED_PLANS else ()
    for name in (*_DIVIDED, *DERIVED_DIVIDED.get(spec.model_type, ())):
        value = spec.config.get(name)
        if value is not None and int(value) % tp and name not in whole:
            raise ConfigError(f"{where}: {name}={value} is not divisible by --tp {tp}")
    for name in _ATTENTION_DROPOUT:
        if spec.config.get(name):
            raise ConfigError(f"{where}: {name}={spec.config[name]} drops attention probabilities of the heads split "
                              "over the ranks, whose masks --tp does not draw as one process does; set it to 0 in "
                              "config.json or train with --tp 1")
    if spec.model_type in DERIVED_PLANS:
        _check_roles(spec, where)


def _check_roles(spec: HFModelConfig, where: str) -> None:
    """``check_block_roles`` on one block of ``spec``'s model, built on meta."""
    layers = next((key for key in ("n_layer", "num_layers") if key in spec.config), "num_hidden_layers")
    one = meta_model(HFModelConfig(source=spec.source, architecture=spec.architecture,
                                   config={**spec.config, layers: 1}))
    stack, blocks = block_stack(one)
    check_block_roles(blocks[0], block_tp_styles(spec, stack.split(".")[-1], blocks[0]), where)


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """transformers' ``*ScaledWordEmbedding`` (Gemma's: the rows looked up times the buffer
    ``embed_scale``, in the weights' dtype) split over the vocabulary. The scale multiplies the
    all-reduced rows: each token's row comes from one rank, so the product is the same."""

    embed_scale: torch.Tensor

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.embed_scale.to(self.weight.dtype)


def _is_scaled_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers scaled word embedding (``ScaledVocabParallelEmbedding``'s
    original): an ``nn.Embedding`` subclass so named, with an ``embed_scale`` buffer."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and isinstance(getattr(module, "embed_scale", None), torch.Tensor))


def _pattern(key: str) -> re.Pattern:
    """``layers.*.mlp.up_proj`` -> a regex of the module names it covers (``*`` is a block index)."""
    return re.compile(r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in key.split(".")) + "$")


def _style_of(plan: list[tuple[re.Pattern, str]], name: str) -> str | None:
    return next((style for pattern, style in plan if pattern.search(name)), None)


def block_tp_styles(spec: HFModelConfig, stack: str, block: nn.Module, index: int = 0) -> dict[str, str]:
    """The style (``colwise``/``rowwise``) of each module of block ``index`` that the family's plan
    splits, by its name relative to the block; ``stack``: the block stack's attribute in the base
    model (``layers``). What ``shard_hf_model`` splits, and what the planner's per-rank shapes
    (``planner.hf_shape``) split."""
    plan = [(_pattern(key), style) for key, style in hf_tp_plan(spec).items()]
    styles = {name: _style_of(plan, f"{stack}.{index}.{name}") for name, _ in block.named_modules()}
    return {name: style for name, style in styles.items() if style is not None}


_PLAIN_LINEARS = ("FalconLinear",)
"""``nn.Linear`` subclasses of transformers whose forward is the plain x W^T + b (read in their source)."""


def _meta_linear(linear: nn.Linear, style: str, group: dist.ProcessGroup, in_region: bool = True,
                 parts: int = 1) -> nn.Module:
    """The ``style`` parallel layer of ``linear``'s shape, its (sharded) parameters on meta. A
    column-parallel one takes its input in the region its parent entered (``_enter_region``), or
    enters it itself (``in_region=False``); ``parts``: its output packs that many parts, each split.
    transformers' ``Conv1D`` (colwise or rowwise) keeps its (in, out) weight."""
    if is_conv1d(linear) and style in ("colwise", "rowwise"):
        in_features, out_features = linear.weight.shape
        with torch.device("meta"):
            if style == "colwise":
                return ColumnParallelConv1D(in_features, out_features, group=group, parts=parts,
                                            input_in_region=in_region)
            return RowParallelConv1D(in_features, out_features, group=group)
    plain = type(linear) is nn.Linear or (isinstance(linear, nn.Linear) and type(linear).__name__ in _PLAIN_LINEARS)
    if not plain or parts != 1:
        raise ConfigError(f"--tp: expected an nn.Linear to split {style}, found {type(linear).__name__}")
    with torch.device("meta"):
        if style.startswith("colwise"):
            return ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                        group=group, input_in_region=in_region,
                                        gather_output=style == "colwise_gather_output")
        return RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                                 input_is_parallel=style == "rowwise")


def _enter_region(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make ``module`` (an attention or MLP whose column-parallel layers all read its input) enter
    the TP region once, on its ``hidden_states`` (or first argument): q, k and v (gate and up) then
    share one all-reduce of their input gradients, as our GPT's fused QKV does, not one each.
    NOTE: only the column-parallel layers may read that input in the module: the families of
    ``TP_FAMILIES`` were checked for it (a replicated reader would count its gradient tp times)."""
    def hook(mod, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = {**kwargs, "hidden_states": copy_to_tp_region(kwargs["hidden_states"], group)}
        elif args:
            args = (copy_to_tp_region(args[0], group), *args[1:])
        else:
            raise ConfigError(f"--tp: {type(mod).__name__} was called without its input")
        return args, kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True)


def _sum_grads_over(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make the gradients of ``module``'s parameters (kept whole on every rank) the sum over the ranks
    of ``group``: a hook on each parameter all-reduces its gradient before it is accumulated.
    NOTE: hooked at each forward, not once here: ``LazyHFModel.materialize`` replaces the meta
    parameters with new ones (the window only swaps their ``.data``, which keeps a hook); the
    ``tp_grad_summed`` tag keeps it to one hook per parameter, so micro-batches and recomputed
    forwards never sum twice."""
    def hook(mod, args):
        for param in mod.parameters(recurse=False):
            if param.requires_grad and not getattr(param, "tp_grad_summed", False):
                param.register_hook(lambda grad: all_reduce(grad, group))
                param.tp_grad_summed = True

    module.register_forward_pre_hook(hook)


def _keep_head_rows(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Give ``module`` (on meta) this rank's rows of each of its parameters, (heads, ...) -> (heads/tp,
    ...), tagged ``tp_split`` so that ``LazyHFModel.materialize`` reads only them."""
    for name, param in list(module.named_parameters(recurse=False)):
        local = nn.Parameter(torch.empty(param.shape[0] // group_size(group), *param.shape[1:], device="meta"),
                             requires_grad=param.requires_grad)
        setattr(module, name, mark_tp_split(local, 0, group))


@torch.no_grad()
def shard_hf_model(lazy: LazyHFModel, group: dist.ProcessGroup | None) -> None:
    """Split ``lazy``'s model in place across the ranks of ``group`` (nothing when it has one rank):
    its blocks' projections by the family's plan (still on meta: ``LazyHFModel.materialize`` keeps each
    rank's slice of what it reads), its embedding and LM head over the vocabulary (loaded: sliced
    here). ``check_hf_tp`` must have accepted the model."""
    tp = group_size(group)
    if tp == 1:
        return
    spec, model = lazy.spec, lazy.model
    check_hf_tp(spec, tp)
    plan = [(_pattern(key), style) for key, style in hf_tp_plan(spec).items()]
    stack = lazy.blocks_name.split(".")[-1]  # the plan names modules from the base model: layers.3.mlp
    for index, block in enumerate(lazy.blocks):
        entered: set[str] = set()
        for name, module in list(block.named_modules()):
            style = _style_of(plan, f"{stack}.{index}.{name}")
            if style == EXPERTS_STYLES["experts"]:
                shard_experts(module, group)
            elif style == GRAD_SUMMED:
                _sum_grads_over(module, group)
            elif style == HEAD_ROWS:
                _keep_head_rows(module, group)
            elif style is not None:
                parent, _, attr = name.rpartition(".")
                # NOTE: a block's own input is read by its residual too: a layer right in the block
                # (OPT's fc1) enters the region on its own input
                parts = PACKED_PARTS.get(spec.model_type, {}).get(name, 1)
                setattr(block.get_submodule(parent), attr,
                        _meta_linear(module, style, group, in_region=bool(parent), parts=parts))
                if style.startswith("colwise") and parent and parent not in entered:
                    _enter_region(block.get_submodule(parent), group)
                    entered.add(parent)
    localize_heads(spec.model_type, spec.config, lazy.blocks, group)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    scaled = _is_scaled_embedding(embedding)
    if (type(embedding) is not nn.Embedding and not scaled) or type(head) is not nn.Linear:
        raise ConfigError(f"--tp {tp}: {spec.architecture}'s embedding ({type(embedding).__name__}) or LM head "
                          f"({type(head).__name__}) is not a plain nn.Embedding / nn.Linear; train it with --tp 1")
    tied = head.weight is embedding.weight
    with torch.device("meta"):
        new_embedding = (ScaledVocabParallelEmbedding if scaled else VocabParallelEmbedding)(
            embedding.num_embeddings, embedding.embedding_dim, group=group, padding_idx=embedding.padding_idx)
        new_head = ColumnParallelLinear(head.in_features, head.out_features, bias=head.bias is not None, group=group)
    if scaled:
        new_embedding.register_buffer("embed_scale", embedding.embed_scale, persistent=False)
    new_embedding.weight = tp_shard_parameter(embedding.weight, new_embedding.weight.tp_split,
                                              embedding.weight.requires_grad)
    new_head.weight = new_embedding.weight if tied else tp_shard_parameter(
        head.weight, new_head.weight.tp_split, head.weight.requires_grad)
    if head.bias is not None:
        new_head.bias = tp_shard_parameter(head.bias, new_head.bias.tp_split, head.bias.requires_grad)
    model.set_input_embeddings(new_embedding)
    model.set_output_embeddings(new_head)
