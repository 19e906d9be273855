"""The plan: the split K / W, the step time, the largest model (bytes: ``planner/memory.py``).

All figures are per rank unless they say otherwise (host and disk are per machine: every
``tp * dp`` rank runs on one machine and they share its memory, CPUs and NVMe).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pystronghold.models.gpt import GPTConfig
from pystronghold.planner.cost import BlockCosts, Workload, analytic_window, block_costs
from pystronghold.planner.hardware import Hardware
from pystronghold.planner.memory import DeviceMemory, HostMemory, device_memory, host_memory
from pystronghold.planner.params import model_params
from pystronghold.planner.timeline import StepTime, choose_window, simulate_step, with_sequence_costs
from pystronghold.planner.trainable import param_split

if TYPE_CHECKING:
    from pystronghold.planner.sequence import LongestContext

__all__ = ["Plan", "Split", "LargestModel", "max_window_with", "most_resident", "choose_split", "make_plan",
           "largest_layers", "largest_models"]


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
    """Parameters of the whole model (all ranks), LoRA adapters not included."""
    costs: BlockCosts
    """Per-block bytes and seconds on one rank."""
    window: int
    """W: slots on the device for the streamed blocks (chosen, or as asked; 0 when K = N)."""
    window_asked: int | None
    """The W that was asked for; None: chosen by the planner."""
    max_window: int
    """Largest W that fits the device beside the K resident blocks (0: not even one slot fits)."""
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
    resident_blocks: int = 0
    """K: the first K blocks stay on the device with a device AdamW (chosen, or as asked)."""
    resident_asked: int | None = None
    """The K that was asked for; None: chosen by the planner."""
    resident_recompute: bool = False
    """The resident blocks recompute in backward (memory demanded it); False: they keep activations."""
    trainable_params: int = 0
    """Parameters that train (all ranks): ``params`` in a full fine-tune, the LoRA adapters, or
    all but the frozen ones."""
    frozen_params: int = 0
    """Parameters that do not train (all ranks)."""
    longest: "LongestContext | None" = None
    """The longest context that fits this model and machine (filled by ``sequence.longest_context``)."""

    @property
    def streamed_blocks(self) -> int:
        """Blocks that stream through the window (N - K)."""
        return self.config.layers - self.resident_blocks

    @property
    def recomputed_blocks(self) -> int:
        """Blocks that recompute their forward in backward."""
        return ((self.streamed_blocks if self.work.checkpointing else 0)
                + (self.resident_blocks if self.resident_recompute else 0))

    @property
    def fits(self) -> bool:
        """The model trains on this machine with this K and W."""
        slots_ok = self.max_window >= 1 or self.streamed_blocks == 0
        return slots_ok and self.device.fits and self.host.fits

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second over all data-parallel ranks (0 when it does not fit)."""
        if self.step is None:
            return 0.0
        seq = self.work.seq or self.config.seq_len
        return self.work.batch * seq * self.work.dp_size / self.step.total_s


def _costs(config: GPTConfig, work: Workload, hw: Hardware, streamed: int | None = None
           ) -> tuple[BlockCosts, HostMemory]:
    """Block costs and the host store of ``streamed`` blocks (default: all); when some of its
    states are on disk, each host update also bears its share of the store's disk traffic."""
    streamed = config.layers if streamed is None else streamed
    ranks = config.tp_size * work.dp_size
    costs = block_costs(config, work, hw)
    host = host_memory(costs, work, hw, streamed, ranks)
    if host.tier == "nvme":  # the host updates now also read and write the disk
        costs = block_costs(config, work, hw,
                            nvme_bytes_per_param=host.disk_step_bytes / (ranks * streamed * costs.block_params))
    return costs, host


@dataclass(frozen=True, slots=True)
class Split:
    """Where the blocks go: K resident (recomputing or not), N - K streamed through W slots."""

    resident: int
    """K."""
    resident_recompute: bool
    """The resident blocks recompute in backward."""
    window: int
    """W (0 when K = N)."""
    max_window: int
    """Most slots that fit beside the K resident blocks."""
    step: StepTime | None
    """Predicted step (None when it does not fit)."""


def max_window_with(costs: BlockCosts, work: Workload, n: int, capacity_bytes: int, resident: int,
                    resident_recompute: bool, in_flight: int = 1) -> int:
    """Most slots (<= N - K) that fit the device beside K resident blocks; -1 when even the
    resident blocks, head, tail and activations (of ``in_flight`` micro-batches) do not fit
    (0 slots is fine when K = N)."""
    base = device_memory(costs, work, n, 0, capacity_bytes, resident, resident_recompute, in_flight=in_flight)
    if not base.fits:
        return -1
    return min(n - resident, (capacity_bytes - base.peak_bytes) // costs.slot_bytes)


def most_resident(costs: BlockCosts, work: Workload, n: int, capacity_bytes: int, window: int = 1,
                  in_flight: int = 1) -> int:
    """Most resident blocks (recomputing when ``work.checkpointing``) that fit the device beside
    ``window`` slots for the others (none when all N are resident); -1 when not even K = 0 fits.
    The device bytes grow with K (a resident block holds more than its share of a slot)."""
    def fits(k: int) -> bool:
        return device_memory(costs, work, n, 0 if k == n else window, capacity_bytes, k, work.checkpointing,
                             in_flight=in_flight).fits

    if fits(n):
        return n
    if not fits(0):
        return -1
    lo, hi = 0, n  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _resident_candidates(n: int) -> list[int]:
    """K values to try: every one up to 64 blocks, else about 64 evenly spaced (and N)."""
    stride = max(1, -(-n // 64))
    return sorted({*range(0, n + 1, stride), n})


def choose_split(costs: BlockCosts, work: Workload, n: int, capacity_bytes: int, *,
                 window: int | None = None, resident: int | None = None,
                 tolerance: float = 0.01, in_flight: int = 1) -> Split:
    """K, the resident blocks' recompute and W with the best predicted step that fits the device.

    Every K (as asked, or each candidate) with the resident blocks keeping their activations, and
    recomputing when ``work.checkpointing`` (it frees memory for more K or W) is simulated at its
    largest W (or the W asked); among those within ``tolerance`` of the best step the largest K
    wins (host updates and transfers are what the model predicts least well), then no recompute,
    then the smallest W within ``tolerance`` of that K's best (``choose_window``). Resident blocks
    are always the first ones (their host update would have the least time to hide). With a
    ``window`` asked and K chosen, at least ``window`` blocks stream (K <= N - W). ``in_flight``:
    micro-batches whose activations are held at once (see ``device_memory``)."""
    if resident is not None:
        ks = [resident]
    elif window is not None:  # a window asked for streams at least that many blocks
        ks = _resident_candidates(max(0, n - window))
    else:
        ks = _resident_candidates(n)
    recomputes = (False, True) if work.checkpointing else (False,)
    feasible = []  # (total, k, recompute, max_w)
    for k in ks:
        for rc in recomputes:
            max_w = max_window_with(costs, work, n, capacity_bytes, k, rc, in_flight)
            if max_w < 0 or (k < n and max_w < 1):
                continue
            w = 0 if k == n else (min(window, n - k) if window is not None else max_w)
            if window is not None and k < n and w > max_w:
                continue
            st = simulate_step(costs, n, w, work.overlap, resident=k, resident_recompute=rc)
            feasible.append((st.total_s, k, rc, max_w))
    if not feasible:  # nothing fits: report K as asked (or 0) with W = 1
        k = resident or 0
        return Split(resident=k, resident_recompute=False, window=0 if k == n else min(window or 1, n - k),
                     max_window=max(0, max_window_with(costs, work, n, capacity_bytes, k, False, in_flight)),
                     step=None)
    best = min(t for t, *_ in feasible)
    _, k, rc, max_w = max((c for c in feasible if c[0] <= best * (1 + tolerance)),
                          key=lambda c: (c[1], not c[2]))
    if window is not None or k == n:
        w = 0 if k == n else min(window, n - k)
        st = simulate_step(costs, n, w, work.overlap, resident=k, resident_recompute=rc)
    else:
        w, st = choose_window(costs, n, max_w, work.overlap, tolerance, resident=k, resident_recompute=rc)
    return Split(resident=k, resident_recompute=rc, window=w, max_window=max_w, step=st)


def _store_streamed(config: GPTConfig, work: Workload, hw: Hardware, costs: BlockCosts, split: Split
                    ) -> tuple[BlockCosts, HostMemory, Split]:
    """Costs, host store and split once the host store holds the N - K streamed blocks only (placed,
    their updates costed, the step simulated again when that changed the costs)."""
    k, rc = split.resident, split.resident_recompute
    streamed_costs, host = _costs(config, work, hw, config.layers - k)
    if streamed_costs != costs and split.step is not None:
        split = dataclasses.replace(split, step=simulate_step(streamed_costs, config.layers, split.window,
                                                              work.overlap, resident=k, resident_recompute=rc))
    return streamed_costs, host, split


def make_plan(config: GPTConfig, work: Workload, hw: Hardware, window: int | None = None,
              resident_blocks: int | None = None, *, in_flight: int = 1) -> Plan:
    """Plan ``config`` trained as ``work`` on ``hw`` with ``window`` slots and the first
    ``resident_blocks`` blocks device-resident (None: chosen, see ``choose_split``). ``in_flight``:
    micro-batches whose activations are held at once (a pipeline stage's; see ``device_memory``)."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    n = config.layers
    if resident_blocks is not None and (not isinstance(resident_blocks, int) or isinstance(resident_blocks, bool)
                                        or not 0 <= resident_blocks <= n):
        raise ValueError(f"resident_blocks must be an int in [0, {n}] or None, got {resident_blocks!r}")
    costs, host = _costs(config, work, hw)
    split = choose_split(costs, work, n, hw.gpu.memory_bytes, window=window, resident=resident_blocks,
                         in_flight=in_flight)
    costs, host, split = _store_streamed(config, work, hw, costs, split)
    if not host.fits and resident_blocks is None:  # more resident blocks leave fewer in the host store
        most = most_resident(costs, work, n, hw.gpu.memory_bytes, window or 1, in_flight)
        if most > split.resident and _costs(config, work, hw, n - most)[1].fits:
            lo, hi = split.resident, most  # the host store fits with hi resident blocks, not with lo
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if _costs(config, work, hw, n - mid)[1].fits else (mid, hi)
            more = choose_split(costs, work, n, hw.gpu.memory_bytes, window=window, resident=hi, in_flight=in_flight)
            costs, host, split = _store_streamed(config, work, hw, costs, more)
    k, rc = split.resident, split.resident_recompute
    step = split.step
    if step is not None and (work.offload_block_inputs or work.head_tail_on_host):
        offloaded = (n - k) if work.offload_block_inputs and work.checkpointing else 0
        step = with_sequence_costs(step, costs, offloaded, input_disk_bytes=host.input_disk_bytes,
                                   disk_step_bytes=host.disk_step_bytes, nvme_bytes_per_s=hw.nvme_bytes_per_s)
    params = param_split(config, work.finetune)
    n_frozen = n * sum(params.block_frozen) + params.head_tail_frozen
    n_params = model_params(config)
    plan = Plan(config=config, work=work, hardware=hw, params=n_params, costs=costs,
                window=split.window, window_asked=window, max_window=split.max_window,
                stronghold_window=analytic_window(costs),
                device=device_memory(costs, work, n, split.window, hw.gpu.memory_bytes, k, rc,
                                             in_flight=in_flight), host=host,
                step=step if host.fits else None, resident_blocks=k, resident_asked=resident_blocks,
                resident_recompute=rc, frozen_params=n_frozen,
                trainable_params=n_params if work.finetune.full
                else n * sum(params.block_trainable) + params.head_tail_trainable)
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
    """None when ``layers`` blocks train with W = 1 (and as many resident blocks as the device holds
    beside it, relieving the host store), else what is short ("device", "host", "disk")."""
    cfg = dataclasses.replace(config, layers=layers)
    costs = block_costs(cfg, work, hw)
    most = most_resident(costs, work, layers, hw.gpu.memory_bytes)
    if most < 0:
        return "device"
    _, host = _costs(cfg, work, hw, layers - most)
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
    keeping the model's head size (or 128 when it does not divide the width). A Hugging Face model
    (``HFShape``) keeps its width: one row, its most blocks."""
    widths = sorted(set(widths or [config.hidden, 2048, 4096, 8192, 12288, 16384]))
    if not isinstance(config, GPTConfig):
        widths = [config.hidden]
    rows = []
    for width in widths:
        head_dim = config.head_dim if width % config.head_dim == 0 else 128
        heads = max(1, width // head_dim)
        if width % heads or heads % config.tp_size:
            continue
        cfg = dataclasses.replace(config, hidden=width, heads=heads) if isinstance(config, GPTConfig) else config
        layers, bound = largest_layers(cfg, work, hw)
        if layers == 0:
            rows.append(LargestModel(hidden=width, heads=cfg.heads, layers=0, params=0, bound=bound,
                                     window=0, step_s=0.0))
            continue
        plan = make_plan(dataclasses.replace(cfg, layers=layers), work, hw)
        rows.append(LargestModel(hidden=width, heads=cfg.heads, layers=layers, params=plan.params,
                                 bound=bound, window=plan.window,
                                 step_s=plan.step.total_s if plan.step else 0.0))
    return rows
