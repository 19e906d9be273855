"""Checks and moves done once when a model is wrapped: which parameters are windowed, device
placement, memory budgets. Every refusal here happens before anything is allocated."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
import warnings

import torch

from pystronghold.runtime.memory import layout
from pystronghold.runtime.optimizer.head_tail import head_tail_on_host, host_head_tail_bytes
from pystronghold.runtime.memory.placement import available_host_bytes
from pystronghold.settings.precision import compute_dtype
from pystronghold.runtime.memory.store import BlockLayout

__all__ = ["split_parameters", "move_to_device", "fill_store", "init_threads_for", "INIT_BYTES_IN_FLIGHT",
           "slot_bytes", "device_total_bytes", "materialize_resident", "window_slots", "split_model", "ModelSplit"]

log = logging.getLogger(__name__)


def window_slots(window: int | str, streamed: int, resident: int, stacklevel: int = 4) -> int:
    """W for ``streamed`` blocks: ``window`` ("all" or an int), clamped to ``streamed`` with a warning
    (0 when every block is resident: nothing streams) that ``stacklevel`` places."""
    slots = streamed if window == "all" else window
    if slots > streamed:
        msg = (f"wrap: window={slots} is larger than the {streamed} " + ("streamed " if resident else "")
               + f"blocks; using window={streamed}")
        if streamed:
            warnings.warn(msg, stacklevel=stacklevel)
            log.warning(msg)
        slots = streamed
    return slots


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelSplit:
    """A model split for the window, before anything is allocated (``split_model``)."""

    window: int
    """W: device slots."""
    dtype: torch.dtype
    """Compute precision of parameters and gradients on the device."""
    saved_dtypes: dict[str, torch.dtype]
    """Each parameter's dtype before ``wrap``, by full model name."""
    materialize: object
    """The materializer of the streamed blocks (by their index among them), or None."""
    resident_params: list[list[torch.nn.Parameter]]
    """Parameters of each resident block, layout order."""
    block_named: list[list[tuple[str, torch.nn.Parameter]]]
    """Named parameters of each streamed block, layout order."""
    block_params: list[list[torch.nn.Parameter]]
    """Parameters of each streamed block, layout order."""
    layouts: list[BlockLayout]
    """Store layout of each streamed block."""
    head_tail_params: list[torch.nn.Parameter]
    """Parameters outside the blocks, frozen ones included."""
    planned_arena_bytes: int
    """Bytes of the W slots (parameters + gradients), 0 when nothing streams."""
    device_bytes: int
    """Bytes of head, tail and resident blocks on the device (``layout.head_tail_bytes``)."""
    head_tail_on_host: bool
    """Head and tail train from host memory (``RuntimeConfig.head_tail_on_host``, "auto" resolved)."""
    host_head_tail_bytes: int
    """Host bytes of the head and tail's states when they train from there, else 0."""


def split_model(model: torch.nn.Module, blocks: torch.nn.ModuleList, config, materialize=None) -> ModelSplit:
    """Split ``model`` for ``config`` (a ``RuntimeConfig``): W, the compute dtype, the resident
    blocks (materialized), the streamed blocks' layouts and the device bytes, before anything is
    allocated. ``materialize(i)`` gives block i real parameters (meta-device models)."""
    k, n = config.resident_blocks, len(blocks) - config.resident_blocks
    window = window_slots(config.window, n, k, stacklevel=5)
    dtype = compute_dtype(config.precision)
    saved_dtypes = {name: p.dtype for name, p in model.named_parameters()}
    materialize = materialize_resident(model, blocks, k, materialize)
    block_named, head_tail_params = split_parameters(model, blocks, config.device)
    resident_params = [[p for _, p in named] for named in block_named[:k]]
    block_named = block_named[k:]
    layouts = [BlockLayout(named) for named in block_named]
    resident_bytes = layout.head_tail_bytes([p for ps in resident_params for p in ps], dtype)
    trainable = [p.numel() for p in head_tail_params if p.requires_grad]
    on_host = head_tail_on_host(config.head_tail_on_host, sum(trainable),
                                sum(p.numel() for p in head_tail_params if not p.requires_grad), dtype,
                                device_total_bytes(config.device))
    return ModelSplit(window=window, dtype=dtype, saved_dtypes=saved_dtypes, materialize=materialize,
                      resident_params=resident_params, block_named=block_named,
                      block_params=[[p for _, p in named] for named in block_named], layouts=layouts,
                      head_tail_params=head_tail_params,
                      planned_arena_bytes=window * slot_bytes(layouts, dtype) if n else 0,
                      device_bytes=layout.head_tail_bytes(head_tail_params, dtype, on_host=on_host) + resident_bytes,
                      head_tail_on_host=on_host,
                      host_head_tail_bytes=host_head_tail_bytes(trainable, dtype) if on_host else 0)


def device_total_bytes(device: str) -> int | None:
    """Memory of CUDA ``device`` in bytes; None for the CPU backend (or no CUDA)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def split_parameters(model: torch.nn.Module, blocks: torch.nn.ModuleList, device: str):
    """Block parameters (per block, named relative to the block, in layout order: the trainable
    ones first, then the frozen ones, each in ``named_parameters`` order) and the head/tail
    parameters.

    Refuses a parameter shared between a block and the head/tail or between two blocks (tied
    weights must live in head/tail), parameters on a device other than the host or ``device``,
    blocks that are not part of ``model``, and a model with no trainable parameter.
    """
    if not any(m is blocks for m in model.modules()):
        raise ValueError("wrap: blocks= must be a ModuleList inside the model (e.g. model.blocks)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("wrap: every parameter has requires_grad=False, so there is nothing to train; "
                         "leave requires_grad=True on the parameters to train")
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
            named.append((name, p))
        per_block.append([(n, p) for n, p in named if p.requires_grad]
                         + [(n, p) for n, p in named if not p.requires_grad])
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


INIT_BYTES_IN_FLIGHT = 8 << 30
"""Most bytes of materialized fp32 blocks (counted twice: a parameter's draw is a temporary of its
size) that parallel initialisation keeps ahead of the fill, so a model larger than host memory
still never needs more than this beside the store; lowered to 1/16 of the host's available memory
(the store's default budget leaves 15% of it free)."""


def _materializer(model, block_params, materialize):
    """(the function that builds block i's meta parameters, whether calls for different blocks may
    run in parallel threads); (None, False) when no block is on the meta device. ``materialize`` or
    the model's ``materialize_block_``, parallel only when the model declares it thread-safe
    (``materialize_block_thread_safe``: each block's values independent of thread scheduling)."""
    if not any(p.is_meta for ps in block_params for p in ps):
        return None, False
    if materialize is not None:
        return materialize, bool(getattr(materialize, "thread_safe", False))
    materialize = getattr(model, "materialize_block_", None)
    if materialize is None:
        raise ValueError("wrap: some block parameters are on the meta device; pass materialize=fn "
                         "(fn(i) gives block i real, initialised parameters on the host)")
    return materialize, bool(getattr(model, "materialize_block_thread_safe", False))


def init_threads_for(requested: int, thread_safe: bool, block_numel: int,
                     bytes_in_flight: int = INIT_BYTES_IN_FLIGHT) -> int:
    """Threads that materialize blocks: ``requested`` (0: one per core when ``thread_safe``, else 1),
    at most as many as ``bytes_in_flight`` holds blocks of ``block_numel`` fp32 elements (each
    counted twice), and at least 1."""
    threads = requested or ((os.cpu_count() or 1) if thread_safe else 1)
    return max(1, min(threads, bytes_in_flight // max(1, 2 * 4 * block_numel)))


def materialize_resident(model: torch.nn.Module, blocks: torch.nn.ModuleList, count: int, materialize=None):
    """Build the meta parameters of the first ``count`` blocks (they stay on the device whole) and
    return the materializer of the others, taking their index among the streamed blocks."""
    if count == 0:
        return materialize
    params = [list(b.parameters()) for b in blocks]
    fn, thread_safe = _materializer(model, params, materialize)
    if fn is None:
        return materialize
    for i in range(count):
        if any(p.is_meta for p in params[i]):
            fn(i)
            if any(p.is_meta for p in blocks[i].parameters()):
                raise ValueError(f"wrap: materialize({i}) left block {i} parameters on the meta device")

    def streamed_block(b: int):
        return fn(count + b)

    streamed_block.thread_safe = thread_safe  # the model's own materializer stays parallel (fill_store)
    return streamed_block


def fill_store(store, model: torch.nn.Module, blocks: torch.nn.ModuleList, block_named, block_params,
               materialize=None, threads: int = 0) -> dict:
    """Copy every block's initial values into ``store``, in block order: a meta block is
    materialized first (``materialize(i)``, by ``threads`` worker threads ahead of the copy; see
    ``init_threads_for``), and each block's own storage is dropped once the store has it, so the
    whole model never needs to fit in host memory. ``block_params[i]`` is updated in place to the
    block's Parameter objects (materializing may make new ones). Logs one line with the phases and
    returns them in seconds: ``total``, ``init`` (materializing, summed over threads), ``init_wait``
    (the fill waiting for it), ``arenas`` (making and pinning the store's arenas, overlapped
    with the fill when the store builds them in the background), ``arena_wait``, ``copy``; and
    ``threads``."""
    t_start = time.perf_counter()
    materialize, thread_safe = _materializer(model, block_params, materialize)
    n = len(block_params)
    lazy = [materialize is not None and any(p.is_meta for p in ps) for ps in block_params]
    largest = max((sum(p.numel() for p in ps) for ps in block_params), default=0)
    workers = 0
    if any(lazy):
        in_flight = min(INIT_BYTES_IN_FLIGHT, available_host_bytes() // 16)
        workers = init_threads_for(threads, thread_safe, largest, in_flight)
    times = dict(init=0.0, init_wait=0.0, arena_wait=0.0, copy=0.0)

    def build(b: int) -> float:
        t = time.perf_counter()
        materialize(b)
        return time.perf_counter() - t

    pool = ThreadPoolExecutor(workers, thread_name_prefix="pystronghold-init") if workers > 1 else None
    pending: dict[int, Future] = {}
    ahead = 0  # next block to hand to the pool
    placeholder = torch.empty(0)
    try:
        for b, params in enumerate(block_params):
            while pool is not None and ahead < n and ahead < b + workers:
                if lazy[ahead]:
                    pending[ahead] = pool.submit(build, ahead)
                ahead += 1
            if lazy[b]:
                t = time.perf_counter()
                times["init"] += pending.pop(b).result() if pool is not None else build(b)
                times["init_wait"] += time.perf_counter() - t
                # materializing may make new Parameter objects (to_empty): take the block's own
                own = dict(blocks[b].named_parameters())
                params[:] = [own[name] for name, _ in block_named[b]]
                if any(p.is_meta for p in params):
                    raise ValueError(f"wrap: materialize({b}) left block {b} parameters on the meta device")
                for (name, meta), p in zip(block_named[b], params):
                    if p.requires_grad != meta.requires_grad:
                        raise ValueError(f"wrap: materialize({b}) made block {b} parameter {name!r} with "
                                         f"requires_grad={p.requires_grad}, its meta parameter had "
                                         f"{meta.requires_grad}; keep requires_grad when materializing")
            t = time.perf_counter()
            store.wait_built(b)
            t_copy = time.perf_counter()
            times["arena_wait"] += t_copy - t
            store.fill_from(b, params)
            times["copy"] += time.perf_counter() - t_copy
            for p in params:
                p.data = placeholder
            if (b + 1) % 8 == 0 or b + 1 == n:
                log.debug("store filled: %d/%d blocks", b + 1, n)
        t = time.perf_counter()
        store.wait_built()  # arenas of blocks whose states are all on disk
        times["arena_wait"] += time.perf_counter() - t
    finally:
        if pool is not None:
            for f in pending.values():
                f.cancel()
            pool.shutdown(wait=True)
    times.update(total=time.perf_counter() - t_start, arenas=store.build_s, threads=max(workers, 1))
    log.info("store ready in %.1f s: init %.1f s on %d thread%s (waited %.1f s), arenas %.1f s%s in %d "
             "chunks (waited %.1f s), copy %.1f s", times["total"], times["init"], times["threads"],
             "s" if times["threads"] > 1 else "", times["init_wait"], times["arenas"],
             " pinned" if store.pinned else "", store.arena_count, times["arena_wait"], times["copy"])
    return times


def slot_bytes(layouts: list[BlockLayout], dtype: torch.dtype) -> int:
    """Device bytes of one window slot: the parameters of the largest of ``layouts`` and the
    gradients of the largest trainable part."""
    return layout.slot_bytes(max((lay.numel for lay in layouts), default=0), dtype,
                             max((lay.train_numel for lay in layouts), default=0))
