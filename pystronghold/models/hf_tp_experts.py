"""Tensor parallelism for a Hugging Face mixture of experts (``--tp`` on Qwen2-MoE, Mixtral): every
expert split as a Megatron MLP, the router replicated (no expert parallelism).

transformers holds a family's experts as two 3-D parameters (its plan's ``moe_tp_experts``):
``gate_up_proj`` (E, 2 I, C), each expert's gate rows then its up rows, and ``down_proj`` (E, C, I).
Each rank holds every expert's slice: its rows of the gate part and of the up part (a packed split,
``tp_split = (1, rank, tp, 2)``: ``parallel.layers.tp_slice``) and the matching columns of
``down_proj`` (``(2, rank, tp)``). The experts' own forward then runs unchanged on the slices (its
``chunk(2)`` finds this rank's gate and up) and returns a partial sum, all-reduced once on leaving.

The router reads the replicated hidden states. The experts take the hidden states and the routing
weights into the tensor-parallel region: each rank's gradient of a routing weight is the product
with its partial output, so the region's entry sums them over the ranks, as it sums the hidden
states' gradients.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from pystronghold.models.hf import HF_PREFIX
from pystronghold.options import ConfigError
from pystronghold.parallel.groups import group_rank, group_size
from pystronghold.parallel.mappings import copy_to_tp_region, reduce_from_tp_region

__all__ = ["EXPERTS_STYLES", "shard_experts", "check_expert_rows"]

EXPERTS_STYLES = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise",
                  "experts.down_proj": "rowwise"}
"""The ``base_model_tp_plan`` entries (the end of their keys -> style) that ``shard_experts`` covers."""

_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")
"""The experts' forward arguments, in order (transformers' experts interface)."""
_IN_REGION = ("hidden_states", "top_k_weights")
"""Those replicated on every rank whose gradients the ranks' partial outputs make partial."""


GROUPED_MM_ALIGN = 16
"""Bytes that every row of the operands of torch's grouped matmul (transformers' experts) must be a
multiple of."""


def check_expert_rows(spec, tp: int, itemsize: int) -> None:
    """ValueError (one line) unless a mixture of experts' rows, at ``tp`` ranks and ``itemsize`` bytes
    an element, suit torch's grouped matmul, which transformers runs the experts through: a rank's
    expert width (``moe_intermediate_size``, else ``intermediate_size``) and the hidden size, times
    ``itemsize``, must be multiples of ``GROUPED_MM_ALIGN`` bytes (else torch raises from deep inside
    the first step). Nothing to check for a model without experts."""
    config = spec.config
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return
    name = "moe_intermediate_size" if config.get("moe_intermediate_size") else "intermediate_size"
    for what, elements in ((f"{name}={config[name]} / --tp {tp}", int(config[name]) // tp),
                           (f"hidden_size={config['hidden_size']}", int(config["hidden_size"]))):
        if elements * itemsize % GROUPED_MM_ALIGN:
            raise ConfigError(f"--model {HF_PREFIX}{spec.source} ({spec.model_type}): {what}: a row of {elements} "
                              f"elements of {itemsize} bytes is not a multiple of the {GROUPED_MM_ALIGN} bytes that "
                              "the experts' grouped matmul needs; give another --precision or --tp")


def _meta_shard(param: nn.Parameter, split: tuple[int, ...]) -> nn.Parameter:
    """A meta parameter of this rank's slice of ``param`` for ``split``, tagged with it
    (``LazyHFModel.materialize`` reads the whole tensor and keeps the slice)."""
    dim, _, size, *_ = split
    shape = list(param.shape)
    shape[dim] //= size
    shard = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
    shard.tp_split = split
    return shard


def _enter(module, args, kwargs, *, group):
    args = list(args)
    for i, name in enumerate(_INPUTS):
        if name not in _IN_REGION:
            continue
        if i < len(args):
            args[i] = copy_to_tp_region(args[i], group)
        elif name in kwargs:
            kwargs = {**kwargs, name: copy_to_tp_region(kwargs[name], group)}
        else:
            raise ConfigError(f"--tp: {type(module).__name__} was called without its {name}")
    return tuple(args), kwargs


def _leave(module, args, kwargs, output, *, group):
    return reduce_from_tp_region(output, group)  # (N, C), the partial sums added


def shard_experts(experts: nn.Module, group: dist.ProcessGroup) -> None:
    """Split ``experts`` (transformers' 3-D experts, parameters on meta) across ``group``'s ranks in
    place. ValueError (one line) for experts held otherwise (transposed, with biases, interleaved
    gate and up, or not as ``gate_up_proj`` and ``down_proj``)."""
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    plain = (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == down.dim() == 3
             and getattr(experts, "is_concatenated", True) and not getattr(experts, "is_transposed", False)
             and not getattr(experts, "has_bias", False))
    if not plain:
        raise ConfigError(f"--tp: {type(experts).__name__} does not hold its experts as gate_up_proj (E, 2 I, C) "
                          "and down_proj (E, C, I), which pystronghold splits; train it with --tp 1")
    rank, tp = group_rank(group), group_size(group)
    experts.gate_up_proj = _meta_shard(gate_up, (1, rank, tp, 2))  # (E, 2 I/tp, C): this rank's gate, then up
    experts.down_proj = _meta_shard(down, (2, rank, tp))  # (E, C, I/tp)
    experts.register_forward_pre_hook(partial(_enter, group=group), with_kwargs=True)
    experts.register_forward_hook(partial(_leave, group=group), with_kwargs=True)
