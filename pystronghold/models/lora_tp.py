"""LoRA adapters on tensor-parallel layers (``--lora-rank`` with ``--tp``): each adapter split with
its base layer, under PEFT's names, so that checkpoints gather them and PEFT's format is unchanged.

- A column-parallel base (output features split; its input already in the TP region its parent
  entered, ``models.hf_tp``): A whole, B split on its output. Rank r adds ``B_r (A x)``, its slice of
  ``B A x``.
- A row-parallel base (input features split, partial sums all-reduced): A split on its input, B
  whole. The r-wide partial products ``A_r x_r`` are all-reduced, then B applies to their sum on
  every rank, and the result is added to the base's all-reduced output.

Megatron's and PEFT's ``LoraParallelLinear`` split the same way. A split adapter's parameter
carries ``tp_split`` like its base's; its initial values are the one-process values (``reset``
draws the whole A and keeps this rank's slice).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear
from torch import nn

from pystronghold.options import ConfigError
from pystronghold.parallel.groups import group_size
from pystronghold.parallel.layers import ColumnParallelLinear, RowParallelLinear, tp_slice
from pystronghold.parallel.mappings import all_reduce

__all__ = ["ColumnParallelLora", "RowParallelLora", "TP_LORA_LAYERS"]


class _DownInRegion(torch.autograd.Function):
    """``u = x A^T`` for a whole A whose input x is inside the TP region (the region's entry
    all-reduces x's gradient over the ranks). x's gradient stays this rank's part, ``du_r A`` (du_r:
    from this rank's slice of B), so the entry's sum makes it whole once; A's gradient needs the whole
    du, so du (r wide) is all-reduced for A alone: every rank's A then moves alike."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return F.linear(x, weight)  # (..., r)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight  # (..., in): this rank's part
        whole = all_reduce(grad, ctx.group).reshape(-1, weight.shape[0])  # (N, r)
        grad_weight = whole.T @ x.reshape(-1, weight.shape[1])  # (r, in)
        return grad_x, grad_weight, None


class _LoraDownInRegion(nn.Module):
    """A column-parallel base's LoRA A: whole, ``(r, in)``, reading the base's input inside the
    TP region (``_DownInRegion``)."""

    def __init__(self, in_features: int, r: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(r, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return F.linear(x, self.weight)
        return _DownInRegion.apply(x, self.weight, self.group)


class _ParallelLora(Linear):
    """PEFT's LoRA ``Linear`` whose adapters ``_split`` makes parallel with the base layer."""

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs) -> None:
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        base = self.get_base_layer()
        with torch.device(base.weight.device):  # NOTE: meta while the blocks are: no storage yet
            self._split(base, adapter_name, r, config.lora_bias)

    def _split(self, base: nn.Module, adapter_name: str, r: int, bias: bool) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def reset_lora_parameters(self, adapter_name, init_lora_weights) -> None:
        """PEFT's initial values (A Kaiming-uniform, B zero), a split A's drawn whole, as one process
        draws it (the same numbers from the generator), this rank's slice kept."""
        lora_a = self.lora_A[adapter_name] if adapter_name in self.lora_A else None
        split = getattr(getattr(lora_a, "weight", None), "tp_split", None)
        if init_lora_weights is not True or split is None or lora_a.weight.is_meta:
            super().reset_lora_parameters(adapter_name, init_lora_weights)
            return
        dim, _, size = split
        shape = list(lora_a.weight.shape)
        shape[dim] *= size
        whole = torch.empty(shape, dtype=lora_a.weight.dtype)  # (r, in)
        nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
        lora_a.weight.copy_(tp_slice(whole, split))
        lora_b = self.lora_B[adapter_name]
        nn.init.zeros_(lora_b.weight)
        if lora_b.bias is not None:
            nn.init.zeros_(lora_b.bias)


class ColumnParallelLora(_ParallelLora):
    """LoRA on a ``ColumnParallelLinear`` whose input is in its parent's TP region: A whole,
    ``(r, in)``; B ``(out / tp, r)``, this rank's rows, its output gathered as the base's is."""

    def _split(self, base, adapter_name, r, bias) -> None:
        if not base.input_in_region or base.skip_bias_add:
            raise ConfigError("--lora-rank with --tp: LoRA adapts a column-parallel layer only when its parent "
                              "enters the tensor-parallel region for it (models.hf_tp's layers)")
        self.lora_A[adapter_name] = _LoraDownInRegion(self.in_features, r, base.group)
        lora_b = ColumnParallelLinear(r, self.out_features, bias=bias, group=base.group, input_in_region=True,
                                      gather_output=base.gather_output)
        packed = base.weight.tp_split[3:]  # a packed base (GPT-2's c_attn: q, k, v): B's rows split as its outputs
        for param in lora_b.parameters():
            param.tp_split = (*param.tp_split, *packed)
        self.lora_B[adapter_name] = lora_b


class RowParallelLora(_ParallelLora):
    """LoRA on a ``RowParallelLinear`` reading this rank's slice of its input: A ``(r, in / tp)``,
    this rank's columns (of its input split here when the base's is: ``rowwise_split_input``), its
    products all-reduced; B whole, ``(out, r)`` (PEFT's own)."""

    def _split(self, base, adapter_name, r, bias) -> None:
        if base.skip_bias_add:
            raise ConfigError("--lora-rank with --tp: LoRA adapts a row-parallel layer only when it adds its "
                              "bias (models.hf_tp's layers)")
        self.lora_A[adapter_name] = RowParallelLinear(self.in_features, r, bias=False, group=base.group,
                                                      input_is_parallel=base.input_is_parallel)


TP_LORA_LAYERS = {ColumnParallelLinear: ColumnParallelLora, RowParallelLinear: RowParallelLora}
"""PEFT's custom dispatch (``LoraConfig._register_custom_module``) of a model split by ``models.hf_tp``."""
