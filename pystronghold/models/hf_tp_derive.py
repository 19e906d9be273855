"""Tensor-parallel plans for the Hugging Face families whose config class declares none
(``base_model_tp_plan``), written here per family in the same vocabulary (``models.hf_tp.TP_STYLES``)
so that ``models.hf_tp`` splits them as it splits the others.

Each plan names every linear layer of a block by its role, never by a guess: q, k and v (the MLP's
first layer) column-wise, the attention's output (the MLP's last layer) row-wise. A linear layer of
a block that its family's plan does not name is refused in one line (``check_block_roles``): kept
whole, it would train on one rank's heads only. Layers outside the blocks but the embedding and LM
head (OPT's ``project_in``/``project_out``) stay whole on every rank: they read and write the whole
hidden state, so every rank computes the same gradient.

Where transformers' attention reads its head count to view its projections (GPT-J's
``num_attention_heads``, OPT's ``num_heads``, StableLM's ``num_heads`` and ``num_key_value_heads``:
read in its source), a rank's attention module is given its own count (``LOCAL_HEADS``,
``localize_heads``); q, k and v are split by whole heads, so nothing else changes.
"""

from __future__ import annotations

from torch import nn

__all__ = ["DERIVED_PLANS", "LOCAL_HEADS", "DERIVED_DIVIDED", "derived_tp_plan", "check_block_roles",
           "localize_heads"]

_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}

DERIVED_PLANS: dict[str, dict[str, str]] = {
    "gptj": {**{f"h.*.attn.{n}": s for n, s in _ATTENTION.items()}, "h.*.attn.out_proj": "rowwise",
             "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise"},
    # NOTE: fc1 and fc2 sit in the block itself, whose input the residual reads too: fc1 enters the
    # tensor-parallel region on its own input (models.hf_tp)
    "opt": {**{f"layers.*.self_attn.{n}": s for n, s in _ATTENTION.items()}, "layers.*.self_attn.out_proj": "rowwise",
            "layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"},
    "stablelm": {**{f"layers.*.self_attn.{n}": s for n, s in _ATTENTION.items()}, "layers.*.self_attn.o_proj": "rowwise",
                 "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                 "layers.*.mlp.down_proj": "rowwise"},
}
"""``model_type`` -> its plan (module pattern relative to the base model -> style), for the families
transformers gives none."""

LOCAL_HEADS: dict[str, dict[str, tuple[str, ...]]] = {
    "gptj": {"attn": ("num_attention_heads",)},
    "opt": {"self_attn": ("num_heads",)},
    "stablelm": {"self_attn": ("num_heads", "num_key_value_heads")},
}
"""``model_type`` -> {attention module relative to the block: its head-count attributes that its
forward reads to view q, k and v}: each rank's module gets count / tp."""

DERIVED_DIVIDED: dict[str, tuple[str, ...]] = {"gptj": ("n_head", "n_inner"), "opt": ("ffn_dim",)}
"""``model_type`` -> config.json's names of sizes (beside ``models.hf_tp``'s) that a rank holds an
equal part of."""


def derived_tp_plan(model_type: str) -> dict[str, str]:
    """The plan written here for ``model_type`` ({} for none)."""
    return dict(DERIVED_PLANS.get(model_type, {}))


def check_block_roles(block: nn.Module, styles: dict[str, str], where: str) -> None:
    """ValueError (one line, ``where`` first) naming the first linear layer (``nn.Linear`` or
    transformers' ``Conv1D``) of ``block`` that ``styles`` (name relative to the block -> style,
    ``models.hf_tp.block_tp_styles``) gives no role."""
    for name, module in block.named_modules():
        if (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D") and name not in styles:
            raise ValueError(f"{where}: the block's {name} ({type(module).__name__}) has no role in pystronghold's "
                             "tensor-parallel plan of this family (models.hf_tp_derive); train it with --tp 1")


def localize_heads(model_type: str, block: nn.Module, tp: int) -> None:
    """Give ``block``'s attention (a family of ``LOCAL_HEADS``) this rank's head counts: each / ``tp``."""
    for path, names in LOCAL_HEADS.get(model_type, {}).items():
        attention = block.get_submodule(path)
        for name in names:
            setattr(attention, name, getattr(attention, name) // tp)
