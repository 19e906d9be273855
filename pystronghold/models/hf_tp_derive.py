"""Tensor-parallel plans for the Hugging Face families whose config class declares none
(``base_model_tp_plan``), written here per family in the same vocabulary (``models.hf_tp.TP_STYLES``)
so that ``models.hf_tp`` splits them as it splits the others.

Each plan names every linear layer of a block by its role, never by a guess: q, k and v (the MLP's
first layer) column-wise, the attention's output (the MLP's last layer) row-wise. A linear layer of
a block that its family's plan does not name is refused in one line (``check_block_roles``): kept
whole, it would train on one rank's heads only. Layers outside the blocks but the embedding and LM
head (OPT's ``project_in``/``project_out``) stay whole on every rank: they read and write the whole
hidden state, so every rank computes the same gradient.

q, k and v split by whole heads where the fused projection's layout allows (GPT-2's ``c_attn``
packs [q | k | v]: ``PACKED_PARTS``; BLOOM's and Falcon's ``query_key_value`` interleave them per
head or per key/value group): a rank's attention module is then given its own head counts where
transformers' forward reads them (``LOCAL_HEADS``, read in each family's source), and BLOOM's
attention its own heads' ALiBi rows. Where one key/value head serves every query head (GPT-BigCode's
and Falcon's ``multi_query``) or ALiBi is built over every head inside the model (Falcon's
``alibi``), a split would need transformers' forward patched: the fused projection's output is
gathered instead and the attention runs whole on every rank, the output projection split by its
input (``colwise_gather_output``/``rowwise_split_input``: exact, its weights split, its activations
not).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pystronghold.options import ConfigError
from pystronghold.parallel.groups import group_rank, group_size
from pystronghold.parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_tp_split
from pystronghold.parallel.mappings import copy_to_tp_region, reduce_from_tp_region

__all__ = ["DERIVED_PLANS", "LOCAL_HEADS", "DERIVED_DIVIDED", "PACKED_PARTS", "derived_tp_plan", "undivided",
           "check_block_roles", "localize_heads", "is_conv1d", "ColumnParallelConv1D", "RowParallelConv1D"]

_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}
_FUSED = {"query_key_value": "colwise", "dense": "rowwise"}
_H_TO_4H = {"mlp.dense_h_to_4h": "colwise", "mlp.dense_4h_to_h": "rowwise"}

DERIVED_PLANS: dict[str, dict[str, str]] = {
    "gptj": {**{f"h.*.attn.{n}": s for n, s in _ATTENTION.items()}, "h.*.attn.out_proj": "rowwise",
             "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"},
    # NOTE: fc1 and fc2 sit in the block itself, whose input the residual reads too: fc1 enters the
    # tensor-parallel region on its own input (models.hf_tp)
    "opt": {**{f"layers.*.self_attn.{n}": s for n, s in _ATTENTION.items()},
            "layers.*.self_attn.out_proj": "rowwise", "layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"},
    "stablelm": {**{f"layers.*.self_attn.{n}": s for n, s in _ATTENTION.items()},
                 "layers.*.self_attn.o_proj": "rowwise",
                 "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                 "layers.*.mlp.down_proj": "rowwise"},
    "gpt2": {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
             "h.*.mlp.c_proj": "rowwise"},
    "gpt_bigcode": {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
                    "h.*.mlp.c_proj": "rowwise"},
    "bloom": {**{f"h.*.self_attention.{n}": s for n, s in _FUSED.items()},
              **{f"h.*.{n}": s for n, s in _H_TO_4H.items()}},
    "falcon": {**{f"h.*.self_attention.{n}": s for n, s in _FUSED.items()},
               **{f"h.*.{n}": s for n, s in _H_TO_4H.items()}},
}
"""``model_type`` -> its plan (module pattern relative to the base model -> style), for the families
transformers gives none; ``derived_tp_plan`` gathers a whole-attention layout's."""

LOCAL_HEADS: dict[str, dict[str, tuple[str, ...]]] = {
    "gptj": {"attn": ("num_attention_heads",)},
    "opt": {"self_attn": ("num_heads",)},
    "stablelm": {"self_attn": ("num_heads", "num_key_value_heads")},
    "gpt2": {"attn": ("split_size",)},
    "gpt_bigcode": {"attn": ("num_heads", "kv_heads")},
    "bloom": {"self_attention": ("num_heads",)},
    "falcon": {"self_attention": ("num_heads", "num_kv_heads")},
}
"""``model_type`` -> {attention module relative to the block: its head-count attributes that its
forward reads to view q, k and v}: each rank's module gets count / tp (none when it runs whole)."""

DERIVED_DIVIDED: dict[str, tuple[str, ...]] = {"gptj": ("n_head", "n_inner"), "opt": ("ffn_dim",),
                                               "gpt2": ("n_head", "n_inner"), "gpt_bigcode": ("n_head", "n_inner"),
                                               "bloom": ("n_head",), "falcon": ("num_kv_heads", "ffn_hidden_size")}
"""``model_type`` -> config.json's names of sizes (beside ``models.hf_tp``'s) that a rank holds an
equal part of."""

PACKED_PARTS: dict[str, dict[str, int]] = {"gpt2": {"attn.c_attn": 3}}
"""``model_type`` -> {column-parallel layer relative to the block: the equal parts its output packs}:
GPT-2's ``c_attn`` computes [q | k | v], each split by whole heads, so a rank holds its heads' q, k
and v (``tp_split`` packed: ``parallel.layers.tp_slice``) and its attention splits them by its
``split_size``."""

_ALIBI = {"bloom": "self_attention"}
"""``model_type`` -> its attention (relative to the block), called with ``alibi`` of every head,
(batch * heads, 1, keys), built by the model: each rank's keeps its own heads' rows."""

_GATHERED = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}


def _whole_attention(model_type: str, config) -> bool:
    """Whether ``model_type``'s attention runs whole on every rank for ``config`` (a transformers
    config): one key/value head for all (``multi_query``, unless Falcon's ``new_decoder_architecture``
    groups them), or Falcon's ALiBi over every head."""
    if model_type == "gpt_bigcode":
        return bool(config.multi_query)
    if model_type == "falcon":
        return bool(config.alibi or (config.multi_query and not config.new_decoder_architecture))
    return False


def undivided(model_type: str, config: dict) -> tuple[str, ...]:
    """config.json's key/value head counts that need not divide by tp for ``model_type`` and its
    config.json ``config``: those of an attention that runs whole on every rank."""
    if _whole_attention(model_type, _transformers_config(model_type, config)):
        return ("num_key_value_heads", "num_kv_heads")
    return ()


def _transformers_config(model_type: str, config: dict):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type].from_dict(config)


def derived_tp_plan(model_type: str, config: dict) -> dict[str, str]:
    """The plan written here for ``model_type`` ({} for none) and its config.json ``config``: a
    whole attention's projections gathered and split by input (``_whole_attention``)."""
    plan = dict(DERIVED_PLANS.get(model_type, {}))
    if plan and _whole_attention(model_type, _transformers_config(model_type, config)):
        attention = next(iter(LOCAL_HEADS[model_type]))
        plan = {key: _GATHERED[style] if key.split(".")[2] == attention else style for key, style in plan.items()}
    return plan


def check_block_roles(block: nn.Module, styles: dict[str, str], where: str) -> None:
    """ValueError (one line, ``where`` first) naming the first linear layer (``nn.Linear`` or
    transformers' ``Conv1D``) of ``block`` that ``styles`` (name relative to the block -> style,
    ``models.hf_tp.block_tp_styles``) gives no role."""
    for name, module in block.named_modules():
        if (isinstance(module, nn.Linear) or is_conv1d(module)) and name not in styles:
            raise ConfigError(f"{where}: the block's {name} ({type(module).__name__}) has no role in pystronghold's "
                              "tensor-parallel plan of this family (models.hf_tp_derive); train it with --tp 1")


def localize_heads(model_type: str, config: dict, blocks: Iterable[nn.Module], group: dist.ProcessGroup) -> None:
    """Give each of ``blocks``' attention (a family of ``LOCAL_HEADS``, split by heads for config.json
    ``config``) this rank's head counts, each / tp, and BLOOM's this rank's heads' ALiBi rows."""
    tp, rank = group_size(group), group_rank(group)
    if model_type not in LOCAL_HEADS or _whole_attention(model_type, _transformers_config(model_type, config)):
        return

    def own_heads(module, args, kwargs):
        alibi = kwargs["alibi"]  # (batch * heads, 1, keys)
        heads = alibi.unflatten(0, (-1, module.num_heads * tp))  # (batch, heads, 1, keys)
        mine = heads.narrow(1, rank * module.num_heads, module.num_heads)  # (batch, heads / tp, 1, keys)
        return args, {**kwargs, "alibi": mine.flatten(0, 1)}

    for block in blocks:
        for path, names in LOCAL_HEADS[model_type].items():
            attention = block.get_submodule(path)
            for name in names:
                setattr(attention, name, getattr(attention, name) // tp)
        if model_type in _ALIBI:
            block.get_submodule(_ALIBI[model_type]).register_forward_pre_hook(own_heads, with_kwargs=True)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2's linear layer, ``weight`` (in, out))."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)


class ColumnParallelConv1D(ColumnParallelLinear):
    """transformers' ``Conv1D`` (``weight`` (in, out), y = x W + b, stored so) split by its output
    columns: (..., in) -> (..., out/tp), ``weight`` (in, out/tp) and ``bias`` (out/tp,). ``parts``:
    the output packs that many equal parts, each split (``PACKED_PARTS``)."""

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup, parts: int = 1,
                 input_in_region: bool = True) -> None:
        if out_features % (parts * group_size(group)):
            raise ConfigError(f"--tp: a Conv1D of {out_features} outputs in {parts} parts does not split "
                              f"{group_size(group)} ways")
        super().__init__(in_features, out_features, group=group, input_in_region=input_in_region)
        self.weight = mark_tp_split(nn.Parameter(torch.empty(self.weight.shape[::-1], device=self.weight.device)),
                                    1, group, parts)
        mark_tp_split(self.bias, 0, group, parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = copy_to_tp_region(x, self.group)  # (..., in), gradient summed over ranks
        return F.linear(x, self.weight.t(), self.bias)  # (..., out/tp)


class RowParallelConv1D(RowParallelLinear):
    """transformers' ``Conv1D`` split by its input rows: (..., in/tp) -> (..., out), ``weight``
    (in/tp, out); the partial products all-reduced, the bias (whole) added after."""

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup) -> None:
        super().__init__(in_features, out_features, group=group)
        self.weight = mark_tp_split(nn.Parameter(torch.empty(self.weight.shape[::-1], device=self.weight.device)),
                                    0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp_region(F.linear(x, self.weight.t()), self.group) + self.bias  # (..., out)
