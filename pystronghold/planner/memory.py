"""Device, host and disk bytes of a plan: what the device holds in a step's two phases, and where
the block store goes (host memory, NVMe).

All figures are per rank unless they say otherwise (host and disk are per machine: every
``tp * dp`` rank runs on one machine and they share its memory, CPUs and NVMe).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pystronghold.planner.cost import INPUTS_IN_FLIGHT, BlockCosts, Workload
from pystronghold.planner.hardware import Hardware, format_bytes
from pystronghold.runtime.memory.layout import upload_state
from pystronghold.runtime.memory.placement import plan_placement
from pystronghold.settings.precision import compute_dtype

__all__ = ["DeviceMemory", "HostMemory", "device_memory", "host_memory"]


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Device bytes by use, in the two phases of a step; the peak is the larger phase.

    Forward/backward: window, head/tail, resident blocks and the activations. Optimizer step: the
    activations are freed, and the device AdamW makes fp32 copies of the gradients it updates
    (bf16/fp16): head and tail's, and one resident block's: the resident AdamW
    (``optim/device_adamw.py``) converts one block's gradients at a time, so the largest resident
    block's copies are counted, not K blocks'."""

    window_bytes: int
    """W slots of parameters + gradients."""
    head_tail_bytes: int
    """Head and tail parameters, gradients, fp32 masters and AdamW moments (they stay on the
    device); their fp32 gradient copies are in ``step_grad_bytes``."""
    activation_bytes: int
    """Peak activations: every block's saved input, plus the larger of one block's recompute
    working set (and its input/output gradients) or the loss."""
    reserve_bytes: int
    """Kept free for the CUDA context, workspaces and allocator slack."""
    capacity_bytes: int
    """Device memory of the GPU."""
    resident_bytes: int = 0
    """K device-resident blocks: parameters, gradients, fp32 masters and AdamW moments (their fp32
    gradient copies are in ``step_grad_bytes``)."""
    step_grad_bytes: int = 0
    """fp32 gradient copies alive at once in the optimizer step: head and tail's plus one resident
    block's (0 in fp32, where the gradients are fp32 already)."""

    @property
    def backward_bytes(self) -> int:
        """Forward/backward phase: window, head/tail, resident blocks, activations, reserve; bytes."""
        return (self.window_bytes + self.head_tail_bytes + self.resident_bytes + self.activation_bytes
                + self.reserve_bytes)

    @property
    def step_bytes(self) -> int:
        """Optimizer-step phase: window, head/tail, resident blocks, the fp32 gradient copies,
        reserve (no activations); bytes."""
        return (self.window_bytes + self.head_tail_bytes + self.resident_bytes + self.step_grad_bytes
                + self.reserve_bytes)

    @property
    def peak_bytes(self) -> int:
        """The larger phase, bytes."""
        return max(self.backward_bytes, self.step_bytes)

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
    frozen_disk_blocks: int = 0
    """Blocks whose frozen parameters (the store's upload state) are on disk, per rank."""
    input_host_bytes: int = 0
    """Offloaded block inputs in host memory (``Workload.offload_block_inputs``), all ranks; in
    ``host_bytes``."""
    input_disk_bytes: int = 0
    """Offloaded block inputs on the NVMe tier (what the host memory left by the store cannot
    hold), all ranks; in ``disk_bytes``."""
    head_tail_host_bytes: int = 0
    """Head and tail's host store (``Workload.head_tail_on_host``), all ranks; in ``host_bytes``."""

    @property
    def fits(self) -> bool:
        """Host and disk usage within their capacities."""
        return self.host_bytes <= self.host_capacity_bytes and self.disk_bytes <= self.disk_capacity_bytes


def device_memory(costs: BlockCosts, work: Workload, n_blocks: int, window: int,
                  capacity_bytes: int, resident: int = 0, resident_recompute: bool = False, *,
                  in_flight: int = 1) -> DeviceMemory:
    """Peak device bytes of ``n_blocks`` blocks, the first ``resident`` of them device-resident, the
    others streamed through ``window`` slots (see ``DeviceMemory``).

    Each block keeps its input (recomputed: streamed blocks with checkpointing, resident ones with
    ``resident_recompute``) or its full activations until its backward, once per micro-batch in
    flight (``in_flight``: micro-batches whose forward is done and backward not; a pipeline stage holds
    several, ``planner.pipeline.in_flight_micro_batches``); on top of those the peak holds the loss,
    or one block's recompute working set (its activations and dy, dx), or, when no block recomputes,
    the last block's gradients beside its activations: that working set is there once. The peak
    is the larger of that phase and the optimizer step's (``DeviceMemory``). With
    ``work.offload_block_inputs`` the device holds ``INPUTS_IN_FLIGHT`` recomputed blocks' inputs
    per micro-batch, the others wait on the host (``host_memory``)."""
    if not isinstance(in_flight, int) or isinstance(in_flight, bool) or in_flight < 1:
        raise ValueError(f"in_flight must be a positive int, got {in_flight!r}")
    c = costs
    streamed = n_blocks - resident
    recomputed = (streamed if work.checkpointing else 0) + (resident if resident_recompute else 0)
    kept = n_blocks - recomputed
    working = c.block_activation_bytes + 2 * c.block_input_bytes  # recompute + dy, dx of one block
    extra = working if recomputed else working - c.block_activation_bytes
    if work.offload_block_inputs:  # the others' inputs wait on the host
        recomputed = min(recomputed, INPUTS_IN_FLIGHT)
    acts = (in_flight * (recomputed * c.block_input_bytes + kept * c.block_activation_bytes)
            + max(extra, c.tail_activation_bytes))
    return DeviceMemory(window_bytes=min(window, streamed) * c.slot_bytes,
                        head_tail_bytes=c.head_tail_bytes - c.head_tail_fp32_grad_bytes, activation_bytes=acts,
                        reserve_bytes=work.device_reserve_bytes, capacity_bytes=capacity_bytes,
                        resident_bytes=resident * (c.resident_block_bytes - c.resident_fp32_grad_bytes),
                        step_grad_bytes=c.head_tail_fp32_grad_bytes + (c.resident_fp32_grad_bytes if resident else 0))


def host_memory(costs: BlockCosts, work: Workload, hw: Hardware, n_blocks: int, ranks: int) -> HostMemory:
    """Host (and disk) bytes of the store, placed exactly as the runtime places it
    (``pystronghold.runtime.memory.placement.plan_placement``, frozen parameters included): everything in
    host memory when it fits the host (less the reserve, shared by the ranks), else, with NVMe, the
    states that do not fit go to disk and ``nvme_staging_blocks`` blocks of them are staged in host
    memory.

    Head and tail on the host (``work.head_tail_on_host``) come off the budget first; offloaded
    block inputs (``work.offload_block_inputs``: the ``n_blocks`` streamed blocks' inputs) take the
    host memory the store leaves, the rest goes to the NVMe tier."""
    dtype = compute_dtype(work.precision)
    numels = [costs.block_numel] * n_blocks  # padded, as the runtime's HostStore sizes its buffers
    train_numels = [costs.block_numel - costs.block_frozen_numel] * n_blocks
    place = functools.partial(plan_placement, numels, dtype, train_numels=train_numels)
    budget = max((hw.host_memory_bytes - work.host_reserve_bytes) // ranks - costs.head_tail_host_bytes, 0)
    everything = place(budget_bytes=2**62)
    budget_words = (f"{format_bytes(budget)} of host memory per rank (after the "
                    f"{format_bytes(work.host_reserve_bytes)} reserve)")
    need_words = f"the store needs {format_bytes(everything.host_bytes)} per rank"
    try:
        placement = place(budget_bytes=budget, nvme=bool(hw.nvme_bytes), cache_blocks=work.nvme_staging_blocks,
                          streamed_grads=work.overlap == "backward")
        reason = (f"used: {need_words}, more than the {budget_words}; the states that do not fit go to disk"
                  if placement.spilled else f"not used: {need_words}, which fits the {budget_words}")
    except MemoryError:  # does not fit: report the all-in-host figures (fits is False)
        placement = everything
        reason = (f"not enough: {need_words}, more than the {budget_words}, and even with every state on "
                  f"disk its staging buffers ({work.nvme_staging_blocks} blocks) and the rest do not fit")
    inputs = n_blocks * costs.block_input_bytes if work.offload_block_inputs and work.checkpointing else 0
    inputs_host = min(inputs, max(budget - placement.host_bytes, 0)) if hw.nvme_bytes else inputs
    inputs_disk = inputs - inputs_host
    if inputs_disk:
        reason += f"; {format_bytes(ranks * inputs_disk)} of offloaded block inputs go to disk"
    frozen_on_disk = placement.disk_blocks.get(upload_state(dtype), ()) if costs.block_frozen_numel else ()
    return HostMemory(disk_reason=reason if hw.nvme_bytes else "",tier="nvme" if placement.spilled else "host",
                      host_bytes=ranks * (placement.host_bytes + inputs_host + costs.head_tail_host_bytes)
                      + work.host_reserve_bytes,
                      host_capacity_bytes=hw.host_memory_bytes,
                      disk_bytes=ranks * (placement.disk_bytes + inputs_disk),
                      disk_capacity_bytes=hw.nvme_bytes, disk_states=placement.disk_states,
                      disk_step_bytes=ranks * placement.step_io_bytes(numels, train_numels),
                      frozen_disk_blocks=len(frozen_on_disk), input_host_bytes=ranks * inputs_host,
                      input_disk_bytes=ranks * inputs_disk, head_tail_host_bytes=ranks * costs.head_tail_host_bytes)
