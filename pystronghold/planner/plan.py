"""The plan: memory on device, host and disk, the window W, the step time, the largest model.

All figures are per rank unless they say otherwise (host and disk are per machine: every
``tp * dp`` rank runs on one machine and they share its memory, CPUs and NVMe).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pystronghold.models.gpt import GPTConfig
from pystronghold.models.presets import param_count
from pystronghold.planner.cost import (BlockCosts, Workload, analytic_window, block_costs,
                                       host_bytes_per_param)
from pystronghold.planner.hardware import Hardware
from pystronghold.planner.timeline import StepTime, choose_window, simulate_step
from pystronghold.runtime.placement import plan_placement
from pystronghold.runtime.precision import compute_dtype

__all__ = ["DeviceMemory", "HostMemory", "Plan", "LargestModel", "device_memory", "host_memory",
           "make_plan", "largest_layers", "largest_models"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Device bytes at the peak of a step, by use."""

    window_bytes: int
    """W slots of parameters + gradients."""
    head_tail_bytes: int
    """Head and tail parameters, gradients and their AdamW state (they stay on the device)."""
    activation_bytes: int
    """Peak activations: every block's saved input, plus the larger of one block's recompute
    working set (and its input/output gradients) or the loss."""
    reserve_bytes: int
    """Kept free for the CUDA context, workspaces and allocator slack."""
    capacity_bytes: int
    """Device memory of the GPU."""

    @property
    def peak_bytes(self) -> int:
        """Sum of the uses, bytes."""
        return self.window_bytes + self.head_tail_bytes + self.activation_bytes + self.reserve_bytes

    @property
    def fits(self) -> bool:
        """The peak fits the device."""
        return self.peak_bytes <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Host and disk bytes of the block store on one machine (all its ranks)."""

    tier: str
    """"host": every block state in host memory; "nvme": some states go to disk."""
    host_bytes: int
    """Host memory used: the store (or its host-resident part and staging buffers) plus the reserve."""
    host_capacity_bytes: int
    """Host memory of the machine."""
    disk_bytes: int
    """Bytes on the NVMe tier (0 in tier "host")."""
    disk_capacity_bytes: int
    """NVMe space given (0: none)."""
    disk_states: tuple[str, ...]
    """Which store tiers live on disk (some may be split: the first blocks in host memory)."""
    disk_step_bytes: int = 0
    """Bytes read plus written on disk per training step (all ranks)."""
    disk_reason: str = ""
    """Why the NVMe tier is or is not used, in words ("" without --nvme)."""

    @property
    def fits(self) -> bool:
        """Host and disk usage within their capacities."""
        return self.host_bytes <= self.host_capacity_bytes and self.disk_bytes <= self.disk_capacity_bytes


def device_memory(costs: BlockCosts, work: Workload, n_blocks: int, window: int,
                  capacity_bytes: int, in_flight: int = 1) -> DeviceMemory:
    """Peak device bytes of ``n_blocks`` blocks with ``window`` slots (see ``DeviceMemory``).
    ``in_flight``: micro-batches whose forward is done and backward not (a pipeline stage holds
    several, ``planner.pipeline.in_flight_micro_batches``): each keeps its saved activations; the
    working set of one block's backward is there once."""
    if not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be a positive int, got {in_flight!r}")
    c = costs
    working = c.block_activation_bytes + 2 * c.block_input_bytes  # recompute + dy, dx of one block
    if work.checkpointing:
        acts = in_flight * n_blocks * c.block_input_bytes + max(working, c.tail_activation_bytes)
    else:
        acts = (in_flight * n_blocks - 1) * c.block_activation_bytes + max(working, c.block_activation_bytes
                                                                            + c.tail_activation_bytes)
    return DeviceMemory(window_bytes=min(window, n_blocks) * c.slot_bytes,
                        head_tail_bytes=c.head_tail_bytes, activation_bytes=acts,
                        reserve_bytes=work.device_reserve_bytes, capacity_bytes=capacity_bytes)


def host_memory(costs: BlockCosts, work: Workload, hw: Hardware, n_blocks: int, ranks: int) -> HostMemory:
    """Host (and disk) bytes of the store, placed exactly as the runtime places it
    (``pystronghold.runtime.placement.plan_placement``): everything in host memory when it fits the
    host (less the reserve, shared by the ranks), else, with NVMe, the states that do not fit go to
    disk and ``nvme_staging_blocks`` blocks of them are staged in host memory."""
    dtype = compute_dtype(work.precision)
    numels = [costs.block_params] * n_blocks
    budget = max((hw.host_memory_bytes - work.host_reserve_bytes) // ranks, 0)
    everything = plan_placement(numels, dtype, budget_bytes=2**62)
    budget_words = (f"{budget / 2**30:.1f} GiB of host memory per rank (after the "
                    f"{work.host_reserve_bytes / 2**30:.1f} GiB reserve)")
    need_words = f"the store needs {everything.host_bytes / 2**30:.1f} GiB per rank"
    try:
        placement = plan_placement(numels, dtype, budget_bytes=budget, nvme=bool(hw.nvme_bytes),
                                   cache_blocks=work.nvme_staging_blocks,
                                   streamed_grads=work.overlap == "backward")
        reason = (f"used: {need_words}, more than the {budget_words}; the states that do not fit go to disk"
                  if placement.spilled else f"not used: {need_words}, which fits the {budget_words}")
    except MemoryError:  # does not fit: report the all-in-host figures (fits is False)
        placement = everything
        reason = (f"not enough: {need_words}, more than the {budget_words}, and even with every state on "
                  f"disk its staging buffers ({work.nvme_staging_blocks} blocks) and the rest do not fit")
    return HostMemory(disk_reason=reason if hw.nvme_bytes else "",tier="nvme" if placement.spilled else "host",
                      host_bytes=ranks * placement.host_bytes + work.host_reserve_bytes,
                      host_capacity_bytes=hw.host_memory_bytes, disk_bytes=ranks * placement.disk_bytes,
                      disk_capacity_bytes=hw.nvme_bytes, disk_states=placement.disk_states,
                      disk_step_bytes=ranks * placement.step_io_bytes(numels))


@dataclass(slots=True)
class Plan:
    """What the planner decided for one model on one machine."""

    config: GPTConfig
    """The model."""
    work: Workload
    """How it is trained."""
    hardware: Hardware
    """Where."""
    params: int
    """Parameters of the whole model (all ranks)."""
    costs: BlockCosts
    """Per-block bytes and seconds on one rank."""
    window: int
    """W: slots on the device (chosen, or as asked)."""
    window_asked: int | None
    """The W that was asked for; None: chosen by the planner."""
    max_window: int
    """Largest W that fits the device (0: not even one slot fits)."""
    stronghold_window: int
    """The closed-form W of ``analytic_window`` (no link serialisation), for comparison."""
    device: DeviceMemory
    """Device bytes at the peak with this W."""
    host: HostMemory
    """Host/disk bytes of the store."""
    step: StepTime | None
    """Predicted step time; None when the model does not fit."""
    largest: list["LargestModel"] = field(default_factory=list)
    """Largest trainable model at a few widths (filled by ``largest_models``)."""

    @property
    def fits(self) -> bool:
        """The model trains on this machine with this W."""
        return self.max_window >= 1 and self.device.fits and self.host.fits

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over all data-parallel ranks (0 when it does not fit)."""
        if self.step is None:
            return 0.0
        seq = self.work.seq or self.config.seq_len
        return self.work.batch * seq * self.work.dp_size / self.step.total_s


def _costs(config: GPTConfig, work: Workload, hw: Hardware) -> tuple[BlockCosts, HostMemory]:
    ranks = config.tp_size * work.dp_size
    costs = block_costs(config, work, hw)
    host = host_memory(costs, work, hw, config.layers, ranks)
    if host.tier == "nvme":  # the host updates now also read and write the disk
        costs = block_costs(config, work, hw,
                            nvme_bytes_per_param=host.disk_step_bytes / (ranks * config.layers * costs.block_params))
    return costs, host


def make_plan(config: GPTConfig, work: Workload, hw: Hardware, window: int | None = None, *,
              in_flight: int = 1) -> Plan:
    """Plan ``config`` trained as ``work`` on ``hw`` with ``window`` slots (None: the smallest W
    whose step time is within 1% of the best that fits, see ``choose_window``). ``in_flight``:
    micro-batches whose activations are held at once (a pipeline stage's; see ``device_memory``)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    n = config.layers
    costs, host = _costs(config, work, hw)
    base = device_memory(costs, work, n, 0, hw.gpu.memory_bytes, in_flight)
    max_window = min(n, max(0, (hw.gpu.memory_bytes - base.peak_bytes) // costs.slot_bytes))
    step = None
    if window is not None:
        w = min(window, n)
        if max_window >= 1 and host.fits:
            step = simulate_step(costs, n, w, work.overlap)
    elif max_window >= 1 and host.fits:
        w, step = choose_window(costs, n, max_window, work.overlap)
    else:
        w = 1
    plan = Plan(config=config, work=work, hardware=hw, params=param_count(config), costs=costs,
                window=w, window_asked=window, max_window=max_window,
                stronghold_window=analytic_window(costs),
                device=device_memory(costs, work, n, w, hw.gpu.memory_bytes, in_flight), host=host, step=step)
    if not plan.fits:
        plan.step = None
    return plan


@dataclass(frozen=True, slots=True)
class LargestModel:
    """The most layers that train at one width, and the plan at that size."""

    hidden: int
    """Width C."""
    heads: int
    """Attention heads used at this width."""
    layers: int
    """Most blocks that fit (0: not even one)."""
    params: int
    """Parameters of that model."""
    bound: str
    """What stops one more layer: "device", "host" or "disk"."""
    window: int
    """W the planner chooses at that size."""
    step_s: float
    """Predicted step time at that size, seconds (0 when layers is 0)."""


def _fits_with(config: GPTConfig, work: Workload, hw: Hardware, layers: int) -> str | None:
    """None when ``layers`` blocks train with W = 1, else what is short ("device", "host", "disk")."""
    cfg = dataclasses.replace(config, layers=layers)
    costs, host = _costs(cfg, work, hw)
    if not device_memory(costs, work, layers, 1, hw.gpu.memory_bytes).fits:
        return "device"
    if host.host_bytes > host.host_capacity_bytes:
        return "host"
    if host.disk_bytes > host.disk_capacity_bytes:
        return "disk"
    return None


def largest_layers(config: GPTConfig, work: Workload, hw: Hardware, limit: int = 1 << 20) -> tuple[int, str]:
    """Most blocks of ``config``'s width that train on ``hw`` (with at least one window slot),
    and what stops one more. Memory grows with the layer count, so a doubling then bisection."""
    if _fits_with(config, work, hw, 1) is not None:
        return 0, _fits_with(config, work, hw, 1)
    lo, hi = 1, 2
    while hi <= limit and _fits_with(config, work, hw, hi) is None:
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo, "limit"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits_with(config, work, hw, mid) is None:
            lo = mid
        else:
            hi = mid
    return lo, _fits_with(config, work, hw, hi)


def largest_models(config: GPTConfig, work: Workload, hw: Hardware,
                   widths: list[int] | None = None) -> list[LargestModel]:
    """``LargestModel`` at each width (default: the model's width and 2048, 4096, 8192, 12288, 16384),
    keeping the model's head size (or 128 when it does not divide the width)."""
    widths = sorted(set(widths or [config.hidden, 2048, 4096, 8192, 12288, 16384]))
    rows = []
    for width in widths:
        head_dim = config.head_dim if width % config.head_dim == 0 else 128
        heads = max(1, width // head_dim)
        if width % heads or heads % config.tp_size:
            continue
        cfg = dataclasses.replace(config, hidden=width, heads=heads)
        layers, bound = largest_layers(cfg, work, hw)
        if layers == 0:
            rows.append(LargestModel(hidden=width, heads=heads, layers=0, params=0, bound=bound,
                                     window=0, step_s=0.0))
            continue
        plan = make_plan(dataclasses.replace(cfg, layers=layers), work, hw)
        rows.append(LargestModel(hidden=width, heads=heads, layers=layers, params=plan.params,
                                 bound=bound, window=plan.window,
                                 step_s=plan.step.total_s if plan.step else 0.0))
    return rows
