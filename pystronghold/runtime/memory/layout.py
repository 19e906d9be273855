"""Layout arithmetic: how many bytes the runtime's buffers take, in one place.

The store, placement, disk tier, window slots, memory report and planner all size buffers with
these functions, so a prediction and the run it predicts cannot drift apart. Parameters sit in
one flat buffer per state at ``ALIGN_ELEMS``-aligned offsets (``param_offsets``); buffers round up
to ``ARENA_ALIGN`` bytes. Per block the store holds fp32 ``master``, ``exp_avg``, ``exp_avg_sq``
and, in the compute dtype, ``grad`` and (bf16/fp16) ``shadow``; trainable parameters come first,
frozen ones after (stored once, in the compute dtype). ``slot_bytes`` and
``device_bytes_per_param`` size the window slots and device-trained parameters, ``head_tail_bytes``
the head and tail.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ARENA_ALIGN", "ALIGN_ELEMS", "STATES", "round_up", "param_offsets", "state_dtype",
           "stored_states", "upload_state", "state_numel", "buffer_bytes", "arena_bytes", "slot_bytes",
           "host_bytes_per_param", "frozen_bytes_per_param", "device_bytes_per_param", "head_tail_bytes"]

ARENA_ALIGN = 4096
"""Bytes: the alignment of every arena and every per-block buffer in it (a page; what O_DIRECT
file I/O needs)."""
ALIGN_ELEMS = 16
"""Parameter offsets inside a block buffer are multiples of this many elements (64 bytes in fp32)."""
STATES = ("master", "exp_avg", "exp_avg_sq", "grad", "shadow")
"""Per-block states of the store, in this order."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return (n + multiple - 1) // multiple * multiple


def param_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """Element offsets of parameters of ``numels`` elements packed in one flat buffer, each at a
    multiple of ``ALIGN_ELEMS``, and the buffer's padded element count (at least ``ALIGN_ELEMS``)."""
    offsets, end = [], 0
    for numel in numels:
        end = round_up(end, ALIGN_ELEMS)
        offsets.append(end)
        end += int(numel)
    return offsets, max(round_up(end, ALIGN_ELEMS), ALIGN_ELEMS)


def state_dtype(state: str, compute_dtype: torch.dtype) -> torch.dtype:
    """fp32 for the optimizer states, the compute dtype for grad and shadow."""
    return compute_dtype if state in ("grad", "shadow") else torch.float32


def stored_states(compute_dtype: torch.dtype) -> tuple[str, ...]:
    """The states the store holds when training in ``compute_dtype`` (``shadow`` only in bf16/fp16)."""
    return tuple(s for s in STATES if s != "shadow" or compute_dtype != torch.float32)


def upload_state(compute_dtype: torch.dtype) -> str:
    """The state a load copies to the device, which alone holds the frozen parameters: the shadow
    in bf16/fp16, the master in fp32."""
    return "master" if compute_dtype == torch.float32 else "shadow"


def state_numel(state: str, numel: int, train_numel: int, compute_dtype: torch.dtype) -> int:
    """Elements of ``state`` for a block of ``numel`` padded elements whose trainable parameters
    take the first ``train_numel``: all of them for the upload state, ``train_numel`` otherwise."""
    return numel if state == upload_state(compute_dtype) else train_numel


def buffer_bytes(numel: int, state: str, compute_dtype: torch.dtype) -> int:
    """Bytes of one flat buffer of ``numel`` elements of ``state`` (rounded up to ``ARENA_ALIGN``)."""
    return round_up(numel * state_dtype(state, compute_dtype).itemsize, ARENA_ALIGN)


def arena_bytes(buffers_bytes: int) -> int:
    """Capacity in bytes of an arena that holds ``ARENA_ALIGN``-rounded buffers totalling
    ``buffers_bytes``: one alignment of slack for the arena's own base."""
    return buffers_bytes + ARENA_ALIGN


def slot_bytes(block_numel: int, compute_dtype: torch.dtype, grad_numel: int | None = None) -> int:
    """Device bytes of one window slot for a block of ``block_numel`` padded elements: a parameter
    buffer and a gradient buffer of ``grad_numel`` elements (default ``block_numel``; fewer when
    parameters are frozen) in the compute dtype, each rounded up to ``ARENA_ALIGN``."""
    grad_numel = block_numel if grad_numel is None else grad_numel
    return (round_up(block_numel * compute_dtype.itemsize, ARENA_ALIGN)
            + round_up(grad_numel * compute_dtype.itemsize, ARENA_ALIGN))


def host_bytes_per_param(compute_dtype: torch.dtype) -> int:
    """Host store bytes per trainable block parameter, padding aside: fp32 master and two moments (12) plus
    the gradient and, in bf16/fp16, the shadow in the compute dtype (16 in every precision)."""
    return sum(state_dtype(s, compute_dtype).itemsize for s in stored_states(compute_dtype))


def frozen_bytes_per_param(compute_dtype: torch.dtype) -> int:
    """Host store bytes per frozen block parameter, padding aside: its value in the compute dtype
    (2 in bf16/fp16, 4 in fp32)."""
    return compute_dtype.itemsize


def device_bytes_per_param(compute_dtype: torch.dtype, *, master_grads: bool = True,
                           optimizer_on_host: bool = False) -> int:
    """Device bytes per parameter trained on the device: parameter and gradient in the compute dtype,
    two fp32 moments and, in bf16/fp16, an fp32 master plus (``master_grads``) its fp32 gradient.
    ``optimizer_on_host`` (head and tail with ``head_tail_on_host``): the parameter and its gradient
    only; the rest is on the host (``host_bytes_per_param``)."""
    s = compute_dtype.itemsize
    if optimizer_on_host:
        return 2 * s
    half = compute_dtype != torch.float32
    return 2 * s + 8 + ((4 + (4 if master_grads else 0)) if half else 0)


def head_tail_bytes(params: list[torch.Tensor], dtype: torch.dtype, *, on_host: bool = False) -> int:
    """Device bytes of the head and tail when training in ``dtype``: parameters and gradients in
    ``dtype``, two fp32 Adam moments, and (bf16/fp16) fp32 masters and their fp32 gradients; a
    frozen parameter (``requires_grad=False``) only its value in ``dtype``. ``on_host``
    (``head_tail_on_host``): parameters and gradients only (``head_tail.host_head_tail_bytes``: the rest)."""
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    return trainable * device_bytes_per_param(dtype, optimizer_on_host=on_host) + frozen * dtype.itemsize
