"""Building the engine's parts from a model, its blocks and a ``RuntimeConfig``.

``build_parts`` plans every byte (window, host store, file tier) before the first allocation, so
a too-small host fails cleanly, then makes the backend, the ``DiskTier`` when states spill, the
filled ``HostStore``, the ``Window`` and the pass plans. ``build_optimizers`` makes the device
AdamW of head, tail and resident blocks, the host updates of streamed blocks and the fp16 loss
scaler. See docs/DESIGN.md "wrap, discovery, configuration".
"""

from __future__ import annotations

import dataclasses

import torch

from pystronghold.io.scratch import check_io_directory
from pystronghold.runtime.memory import layout
from pystronghold.runtime.backends.backend import make_backend
from pystronghold.runtime.config import ResolvedModes, RuntimeConfig
from pystronghold.runtime.memory.disk_tier import DiskTier, disk_tier_bytes, open_scratch
from pystronghold.runtime.optimizer.grad_norms import BlockGradNorms
from pystronghold.runtime.optimizer.head_tail import HostHeadTail
from pystronghold.optim.device_adamw import DeviceAdamW, fused_adamw_for
from pystronghold.runtime.memory.placement import Placement, default_host_budget_bytes, plan_placement
from pystronghold.runtime.optimizer.loss_scale import DynamicLossScaler
from pystronghold.runtime.prepare import fill_store, move_to_device, split_model
from pystronghold.runtime.optimizer.resident import ResidentBlocks
from pystronghold.runtime.streaming.schedule import build_plan
from pystronghold.runtime.memory.store import HostStore
from pystronghold.runtime.optimizer.updates import HostUpdates, undo_bytes
from pystronghold.runtime.streaming.window import Window
from pystronghold.runtime.tracing.trace import Tracer

__all__ = ["EngineParts", "OptimizerParts", "build_parts", "build_optimizers"]


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineParts:
    """The memory side of an engine, as ``build_parts`` made it."""

    n_blocks: int
    """Blocks in the model's stack (resident + streamed)."""
    resident_blocks: list[torch.nn.Module]
    """The first K blocks, which never leave the device."""
    resident_params: list[list[torch.nn.Parameter]]
    """Parameters of each resident block, layout order."""
    streamed_blocks: list[torch.nn.Module]
    """The blocks that stream through the window (local index = model index - K)."""
    block_params: list[list[torch.nn.Parameter]]
    """Placeholder parameters of each streamed block, layout order."""
    real_shapes: dict[int, torch.Size]
    """Real shape of each placeholder block parameter, by id."""
    block_names: list[list[str]]
    """Full model names of each block's parameters (resident blocks first, then streamed)."""
    head_tail_params: list[torch.nn.Parameter]
    """Parameters outside the blocks (device-resident), in ``model.parameters()`` order, frozen
    ones included."""
    head_tail_names: list[str]
    """Full model names of ``head_tail_params``."""
    head_tail_masters: list[torch.Tensor]
    """fp32 masters of the trainable ``head_tail_params`` on the device (on the host with
    ``head_tail_on_host``), from the values before any cast (a frozen parameter has none: it is
    stored once, in the compute dtype)."""
    head_tail_on_host: bool
    """Head and tail train from host memory (``RuntimeConfig.head_tail_on_host``, "auto" resolved)."""
    saved_dtypes: dict[str, torch.dtype]
    """Each parameter's dtype before ``wrap``, by full model name: ``model.state_dict()`` gives the
    fp32 masters in it, as the model would under plain autocast."""
    window_size: int
    """W: device slots."""
    dtype: torch.dtype
    """Compute precision of parameters and gradients on the device."""
    modes: ResolvedModes
    """The overlap and schedule modes in effect ("auto" resolved): what the engine's parts read."""
    planned_arena_bytes: int
    """Bytes of the W slots (parameters + gradients), 0 when nothing streams."""
    placement: Placement
    """Where each block state lives (host store or file tier)."""
    scratch: object | None
    """The open scratch file of the file tier, or None when nothing spills."""
    backend: object
    """CPU or CUDA backend: device arena, copy engine, compute waits."""
    store: HostStore
    """Host store of the streamed blocks' states."""
    fill_times: object
    """Timings of the store fill (``prepare.fill_store``)."""
    window: Window
    """The W device slots and which block holds each."""
    plans: dict[bool, object]
    """Schedule of a pass by ``train`` (``schedule.build_plan``); empty when nothing streams."""
    trace: Tracer
    """Records every action when ``config.trace``."""
    dp_group: object | None
    """Data-parallel process group, or None."""
    tp_group: object | None
    """Tensor-parallel process group, or None."""
    pp_group: object | None
    """Pipeline group (this rank's stages), or None: gradient norms are summed over the stages."""
    parallel: bool
    """More than one rank."""


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerParts:
    """The update side of an engine, as ``build_optimizers`` made it."""

    device_optimizer: DeviceAdamW | HostHeadTail
    """AdamW of head and tail: on the device (fused on CUDA, as the resident blocks'), or over
    masters in host memory with ``head_tail_on_host``."""
    resident: ResidentBlocks
    """Device-resident blocks with their device AdamW."""
    updates: HostUpdates
    """Host Adam updates of streamed blocks (worker thread)."""
    grad_norms: BlockGradNorms
    """Streamed blocks' per-parameter gradient norms, taken where the gradients are."""
    scaler: DynamicLossScaler | None
    """fp16 loss scaler, or None in fp32/bf16."""


def build_parts(model: torch.nn.Module, blocks: torch.nn.ModuleList, config: RuntimeConfig,
                materialize=None) -> EngineParts:
    """Plan, allocate and fill the memory of ``model`` trained through a window (see module doc).
    ``materialize(i)`` gives block i real parameters (meta-device models). ValueError for an empty
    block list or ``resident_blocks`` past it; the placement's error when the host is too small."""
    total = len(blocks)
    if total == 0:
        raise ValueError("wrap: the block list is empty; pass blocks= a non-empty nn.ModuleList")
    k = config.resident_blocks
    if k > total:
        raise ValueError(f"wrap: resident_blocks={k} is more than the {total} blocks")
    n = total - k  # streamed blocks: global index k + local index
    par, modes = config.parallel, config.resolved_modes()
    if config.nvme_dir is not None:
        check_io_directory(config.nvme_dir, flag="nvme_dir=")  # also when nothing spills: fail early
    split = split_model(model, blocks, config, materialize)
    window, dtype, saved_dtypes, materialize = split.window, split.dtype, split.saved_dtypes, split.materialize
    resident_params, block_named, head_tail_params = split.resident_params, split.block_named, split.head_tail_params
    streamed, layouts, block_params = list(blocks)[k:], split.layouts, split.block_params
    planned_arena_bytes = split.planned_arena_bytes
    # NOTE: every byte is planned before the first allocation, so a too-small host fails cleanly.
    def place(modes: ResolvedModes):
        return plan_placement(
            [lay.numel for lay in layouts], dtype, train_numels=[lay.train_numel for lay in layouts],
            budget_bytes=(default_host_budget_bytes() if config.host_memory_bytes is None
                          else int(config.host_memory_bytes)),
            # on the CPU backend the "device" (window arena, head and tail) is host memory too
            fixed_bytes=(planned_arena_bytes + split.device_bytes if config.device == "cpu" else 0)
            + split.host_head_tail_bytes
            + (undo_bytes([lay.train_numel for lay in layouts], dtype) if modes.speculative else 0),
            nvme=config.nvme_dir is not None, cache_blocks=config.nvme_cache_blocks,
            # a speculative update keeps its gradient for a redo
            streamed_grads=modes.overlap == "backward" and not modes.speculative and config.accumulation_steps == 1,
            force_disk=config.nvme_states == "all", budget_is_limit=config.host_memory_bytes is not None)

    placement = place(modes)
    if config.clip_mode == "auto" and config.needs_global_grad and config.overlap == "auto":
        modes, placement = _speculate_if_it_fits(modes, placement, place)
    scratch = None
    if placement.spilled:
        scratch = open_scratch(config.nvme_dir, disk_tier_bytes(placement), preallocate=config.nvme_preallocate)
    store = None
    try:
        # (an arena of one page when every block is resident: nothing streams)
        backend = make_backend(config.device, max(planned_arena_bytes, layout.ARENA_ALIGN), copy_threads=config.copy_threads)

        def disk_factory(placement):
            engine, read_q, write_q = backend.file_io()
            return DiskTier(scratch.path, placement, dtype, engine=engine,
                            read_queue=read_q, write_queue=write_q, arena_factory=backend.host_arena,
                            preallocate=config.nvme_preallocate)

        # NOTE: arenas made (pinned) by a builder thread while the fill runs
        store = HostStore(layouts, dtype, backend.host_arena, placement=placement,
                          disk_factory=disk_factory, background=True)
        fill_times = fill_store(store, model, streamed, block_named, block_params, materialize,
                                threads=config.init_threads)
    except BaseException:
        if store is not None:
            store.close()
        if scratch is not None:
            scratch.close()
        raise
    # fp32 masters of head and tail from the values before any cast (as the store does for blocks)
    masters_at = "cpu" if split.head_tail_on_host else backend.device
    head_tail_masters = [p.detach().to(masters_at, torch.float32) for p in head_tail_params if p.requires_grad]
    move_to_device(model, blocks, backend.device, dtype)
    names = {id(p): name for name, p in model.named_parameters()}
    return EngineParts(
        n_blocks=total, resident_blocks=list(blocks)[:k], resident_params=resident_params,
        streamed_blocks=streamed, block_params=block_params,
        real_shapes={id(p): span.shape for ps, lay in zip(block_params, layouts)
                     for p, span in zip(ps, lay.spans)},  # block parameters are placeholders now
        block_names=[[names[id(p)] for p in ps] for ps in resident_params + block_params],
        head_tail_params=head_tail_params, head_tail_names=[names[id(p)] for p in head_tail_params],
        head_tail_masters=head_tail_masters, head_tail_on_host=split.head_tail_on_host, saved_dtypes=saved_dtypes, window_size=window, dtype=dtype, modes=modes,
        planned_arena_bytes=planned_arena_bytes, placement=placement, scratch=scratch, backend=backend,
        store=store, fill_times=fill_times, window=Window(backend, layouts, block_params, window, dtype),
        plans={train: build_plan(n, window, train) for train in (True, False)} if n else {},
        trace=Tracer(enabled=config.trace, block_offset=k),  # the model's block numbers
        dp_group=par.dp_group if par is not None else None, tp_group=par.tp_group if par is not None else None,
        pp_group=par.pp_group if par is not None else None, parallel=par is not None and par.world_size > 1)


def build_optimizers(parts: EngineParts, config: RuntimeConfig, group_of: dict[int, int]) -> OptimizerParts:
    """The updaters of every parameter; ``group_of``: param group index by id(parameter)
    (``WindowOptimizer.group_of()``)."""
    device = parts.backend.device
    updates = HostUpdates(parts.store, parts.trace, bitwise_torch=config.optimizer.bitwise_torch,
                          prefetch_depth=max(1, config.nvme_cache_blocks - 2),
                          param_groups=[[group_of[id(p)] for p in parts.window.trainable(b)]
                                        for b in range(len(parts.block_params))])
    head_tail = [p for p in parts.head_tail_params if p.requires_grad]  # frozen ones: no optimizer state
    fused = fused_adamw_for(device)  # head, tail and resident blocks alike
    groups = [group_of[id(p)] for p in head_tail]
    if parts.head_tail_on_host:
        head_tail_optimizer = HostHeadTail(head_tail, parts.head_tail_masters, groups, backend=parts.backend,
                                           dtype=parts.dtype, bitwise_torch=config.optimizer.bitwise_torch,
                                           tracer=parts.trace)
    else:
        head_tail_optimizer = DeviceAdamW(head_tail, config.optimizer, parts.head_tail_masters, groups, fused=fused)
    return OptimizerParts(
        device_optimizer=head_tail_optimizer,
        resident=ResidentBlocks(parts.resident_blocks, parts.resident_params, config.optimizer, device,
                                parts.dtype, recompute=config.resident_recompute, group_of=group_of,
                                fused=fused),
        updates=updates,
        # on CUDA the norms come from the slot before the copy-out; on the CPU backend from the host copy
        grad_norms=BlockGradNorms(updates, on_device=device.type == "cuda"),
        scaler=(DynamicLossScaler(config.initial_loss_scale, interval=config.loss_scale_interval)
                if config.precision == "fp16" else None))


def _speculate_if_it_fits(modes: ResolvedModes, placement, place):
    """``clip_mode="auto"``: speculative clipping's modes and placement when its host undo copy fits
    the budget without more of the store on disk than ``placement`` (after-norm's) has; else those given."""
    speculative = dataclasses.replace(modes, overlap="backward", speculative=True)
    try:
        candidate = place(speculative)
    except MemoryError:
        return modes, placement
    if disk_tier_bytes(candidate) > disk_tier_bytes(placement):
        return modes, placement
    return speculative, candidate
