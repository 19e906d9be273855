"""Checks and moves done once when a model is wrapped: which parameters are windowed, device
placement, memory budgets. Every refusal here happens before anything is allocated."""

from __future__ import annotations

import logging
import warnings

import torch

from pystronghold.runtime.store import BlockLayout

__all__ = ["split_parameters", "move_to_device", "fill_store", "slot_bytes", "head_tail_bytes",
           "materialize_resident", "window_slots"]

log = logging.getLogger(__name__)

_ARENA_ALIGN = 4096


def window_slots(window: int | str, streamed: int, resident: int) -> int:
    """W for ``streamed`` blocks: ``window`` ("all" or an int), clamped to ``streamed`` with a warning
    (0 when every block is resident: nothing streams)."""
    slots = streamed if window == "all" else window
    if slots > streamed:
        msg = (f"wrap: window={slots} is larger than the {streamed} " + ("streamed " if resident else "")
               + f"blocks; using window={streamed}")
        if streamed:
            warnings.warn(msg, stacklevel=4)
            log.warning(msg)
        slots = streamed
    return slots


def split_parameters(model: torch.nn.Module, blocks: torch.nn.ModuleList, device: str):
    """Block parameters (per block, named relative to the block) and the head/tail parameters.

    Refuses a parameter shared between a block and the head/tail or between two blocks (tied
    weights must live in head/tail), parameters on a device other than the host or ``device``,
    and blocks that are not part of ``model``.
    """
    if not any(m is blocks for m in model.modules()):
        raise ValueError("wrap: blocks= must be a ModuleList inside the model (e.g. model.blocks)")
    target = torch.device(device)
    block_ids = {id(p) for p in blocks.parameters()}
    for name, p in model.named_parameters():
        if p.is_meta and id(p) in block_ids:
            continue  # built one block at a time by wrap(materialize=...)
        ok = p.device.type == "cpu" or (p.device.type == target.type and
                                        (target.index is None or p.device.index == target.index))
        if not ok:
            raise ValueError(f"wrap: parameter {name!r} is on {p.device}, but device={device!r} was "
                             f"asked for; build the model on the host (cpu) or on {device!r}")
    owner: dict[int, str] = {}
    per_block = []
    for i, block in enumerate(blocks):
        named = []
        for name, p in block.named_parameters():
            if id(p) in owner:
                raise ValueError(f"wrap: block {i} parameter {name!r} is also {owner[id(p)]}; parameters "
                                 "shared between blocks are not supported (each block is windowed alone)")
            owner[id(p)] = f"block {i} {name!r}"
            if p.requires_grad:
                named.append((name, p))
            else:
                raise ValueError(f"wrap: block {i} parameter {name!r} has requires_grad=False; frozen "
                                 "block parameters are not supported yet")
        per_block.append(named)
    block_module_ids = {id(m) for b in blocks for m in b.modules()}
    head_tail = []
    for mod_name, module in model.named_modules():
        if id(module) in block_module_ids:
            continue
        for name, p in module.named_parameters(recurse=False):
            if id(p) in owner:
                raise ValueError(
                    f"wrap: parameter {mod_name + '.' + name!r} outside the blocks is the same tensor as "
                    f"{owner[id(p)]}: a weight tied between a block and the head/tail cannot be "
                    "windowed; untie it or keep it in the head/tail only")
    seen = set()
    for p in model.parameters():
        if id(p) not in owner and id(p) not in seen:
            seen.add(id(p))
            head_tail.append(p)
    return per_block, head_tail


@torch.no_grad()
def move_to_device(model: torch.nn.Module, blocks: torch.nn.ModuleList, device: torch.device,
                   dtype: torch.dtype) -> None:
    """Head/tail parameters and every floating buffer to ``device`` in ``dtype`` (block parameters
    are not touched: they go to the store and then become placeholders)."""
    block_param_ids = {id(p) for p in blocks.parameters()}
    for p in model.parameters():
        if id(p) not in block_param_ids:
            p.data = p.data.to(device=device, dtype=dtype)
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = buf.to(device=device, dtype=dtype if buf.is_floating_point() else None)


def _materializer(model, block_params, materialize):
    """The function that builds block i's meta parameters (``materialize`` or the model's
    ``materialize_block_``); None when no block is on the meta device."""
    if not any(p.is_meta for ps in block_params for p in ps):
        return None
    if materialize is None:
        materialize = getattr(model, "materialize_block_", None)
    if materialize is None:
        raise ValueError("wrap: some block parameters are on the meta device; pass materialize=fn "
                         "(fn(i) gives block i real, initialised parameters on the host)")
    return materialize


def materialize_resident(model: torch.nn.Module, blocks: torch.nn.ModuleList, count: int, materialize=None):
    """Build the meta parameters of the first ``count`` blocks (they stay on the device whole) and
    return the materializer of the others, taking their index among the streamed blocks."""
    if count == 0:
        return materialize
    params = [list(b.parameters()) for b in blocks]
    fn = _materializer(model, params, materialize)
    if fn is None:
        return None
    for i in range(count):
        if any(p.is_meta for p in params[i]):
            fn(i)
            if any(p.is_meta for p in blocks[i].parameters()):
                raise ValueError(f"wrap: materialize({i}) left block {i} parameters on the meta device")
    return lambda b: fn(count + b)


def fill_store(store, model: torch.nn.Module, blocks: torch.nn.ModuleList, block_named, block_params,
               materialize=None) -> None:
    """Copy every block's initial values into ``store``, one block at a time: a meta block is
    materialized first (``materialize(i)``), and each block's own storage is dropped once the store
    has it, so the whole model never needs to fit in host memory. ``block_params[i]`` is updated
    in place to the block's Parameter objects (materializing may make new ones)."""
    materialize = _materializer(model, block_params, materialize)
    placeholder = torch.empty(0)
    n = len(block_params)
    for b, params in enumerate(block_params):
        if materialize is not None and any(p.is_meta for p in params):
            materialize(b)
            # materializing may make new Parameter objects (to_empty): take the block's own
            own = dict(blocks[b].named_parameters())
            params[:] = [own[name] for name, _ in block_named[b]]
            if any(p.is_meta for p in params):
                raise ValueError(f"wrap: materialize({b}) left block {b} parameters on the meta device")
        store.fill_from(b, params)
        for p in params:
            p.data = placeholder
        if (b + 1) % 8 == 0 or b + 1 == n:
            log.info("store filled: %d/%d blocks", b + 1, n)


def head_tail_bytes(params: list[torch.Tensor], dtype: torch.dtype) -> int:
    """Device bytes of the head and tail when training in ``dtype``: parameters and gradients in
    ``dtype``, two fp32 Adam moments, and (bf16/fp16) fp32 masters and their fp32 gradients."""
    numel = sum(p.numel() for p in params)
    return numel * (2 * dtype.itemsize + 8 + (8 if dtype != torch.float32 else 0))


def slot_bytes(layouts: list[BlockLayout], dtype: torch.dtype) -> int:
    """Device bytes of one window slot: parameters and gradients of the largest block, aligned."""
    cap = max((lay.numel for lay in layouts), default=0) * dtype.itemsize
    return 2 * ((cap + _ARENA_ALIGN - 1) // _ARENA_ALIGN * _ARENA_ALIGN)
