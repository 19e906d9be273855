"""The relay schedule in the cost model: link bytes, boundary activations and step time of m
micro-batches under the default (micro-batch-major) and the relay (layer-major, L2L's) schedule,
and the choice between them (``--schedule auto``). See docs/DESIGN.md "Relay schedule".

With N streamed blocks, W slots, P_b·s bytes per block load, P_t·s per gradient and I = B·T·C·s
per block input: default H2D m·(2N − W)·P_b·s + (m − 1)·N·P_t·s, D2H m·N·P_t·s, N·I saved; relay
H2D (2N − W)·P_b·s, D2H N·P_t·s, m·N·I saved (staged through host memory when they do not fit).
Step times come from ``timeline.simulate_step`` and are upper bounds where stated in the code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pystronghold.planner.hardware import format_bytes
from pystronghold.planner.report import format_seconds
from pystronghold.planner.timeline import simulate_step

__all__ = ["ScheduleEstimate", "schedule_estimates", "choose_schedule", "schedule_report"]


@dataclass(frozen=True, slots=True)
class ScheduleEstimate:
    """One schedule's figures for a step of ``micro_batches`` micro-batches on one rank."""

    schedule: str
    """"default" or "relay"."""
    micro_batches: int
    """m."""
    h2d_bytes: int
    """Host-to-device bytes per step: block loads, gradient sums uploaded back (default), staged
    block inputs brought back (relay, staged)."""
    d2h_bytes: int
    """Device-to-host bytes per step: gradient copy-outs, block inputs staged out (relay, staged)."""
    saved_input_bytes: int
    """Bytes of the saved block inputs of a step (default: N·I, relay: m·N·I)."""
    activations: str
    """Where the saved block inputs live: "device", or "host" (relay: staged, they do not fit)."""
    device_budget_bytes: int
    """Device bytes left for saved block inputs once window, head/tail, working set and reserve are
    counted (``relay_activation_bytes`` for the runtime)."""
    step_s: float
    """Predicted step time, seconds."""


def schedule_estimates(plan, micro_batches: int) -> dict[str, ScheduleEstimate]:
    """Both schedules' figures for ``plan`` (a fitting ``planner.plan.Plan``) with m micro-batches."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"schedule_estimates: micro_batches must be an int >= 1, got {micro_batches!r}")
    if plan.step is None:
        raise ValueError("schedule_estimates: the plan does not fit this machine")
    m, c, n_all = micro_batches, plan.costs, plan.config.layers
    k, rc = plan.resident_blocks, plan.resident_recompute
    n = n_all - k  # the streamed blocks: the only ones that cross the link
    w = min(plan.window, n)
    block = c.block_numel * plan.work.dtype_bytes  # what one load moves
    grad = (c.block_numel - c.block_frozen_numel) * plan.work.dtype_bytes  # what one copy-out moves
    loads = n + max(0, n - w)
    resident_held = k * (c.block_input_bytes if rc else c.block_activation_bytes)  # per micro-batch
    # the device bytes the saved inputs may use: capacity minus everything else of the phase that holds them
    others = plan.device.backward_bytes - n * c.block_input_bytes - resident_held
    budget = max(0, plan.device.capacity_bytes - others - m * resident_held)
    overlap = plan.work.overlap
    out = {}
    # default: m passes without updates, the later ones uploading the gradient sum as well
    free = replace(c, adam_s=0.0)
    split = dict(resident=k, resident_recompute=rc)
    first = simulate_step(free, n_all, w, overlap, **split).total_s
    later = simulate_step(replace(free, load_s=c.load_s + c.grad_s), n_all, w, overlap, **split).total_s
    default_s = first + (m - 1) * later + plan.step.exposed_optimizer_s
    # the long-context settings' exposed time (timeline.with_sequence_costs), once per micro-batch
    default_s += m * (plan.step.total_s - simulate_step(c, n_all, w, overlap, **split).total_s)
    offloaded = m * n * c.block_input_bytes if plan.work.offload_block_inputs and plan.work.checkpointing else 0
    out["default"] = ScheduleEstimate(
        schedule="default", micro_batches=m, h2d_bytes=m * loads * block + (m - 1) * n * grad + offloaded,
        d2h_bytes=m * n * grad + offloaded, saved_input_bytes=n * c.block_input_bytes,
        activations="host" if offloaded else "device", device_budget_bytes=budget, step_s=default_s)
    saved = m * n * c.block_input_bytes
    staged = saved > budget
    relay_costs = replace(c, fwd_s=m * c.fwd_s, bwd_s=m * c.bwd_s, head_tail_s=m * c.head_tail_s)
    if staged:
        stage_s = m * c.block_input_bytes / plan.hardware.gpu.h2d_bytes_per_s
        relay_costs = replace(relay_costs, load_s=c.load_s + stage_s)
    relay_s = simulate_step(relay_costs, n_all, w, overlap, **split).total_s
    out["relay"] = ScheduleEstimate(
        schedule="relay", micro_batches=m, h2d_bytes=loads * block + (saved if staged else 0),
        d2h_bytes=n * grad + (saved if staged else 0), saved_input_bytes=saved,
        activations="host" if staged else "device", device_budget_bytes=budget, step_s=relay_s)
    return out


def choose_schedule(plan, micro_batches: int) -> tuple[str, dict[str, ScheduleEstimate]]:
    """"relay" when it is predicted faster than the default (never with one micro-batch: the two
    are the same), else "default"; and both estimates."""
    estimates = schedule_estimates(plan, micro_batches)
    if micro_batches == 1:
        return "default", estimates
    return ("relay" if estimates["relay"].step_s < estimates["default"].step_s else "default"), estimates


def schedule_report(plan, micro_batches: int, schedule: str) -> tuple[dict, str]:
    """What ``pystronghold plan`` says about the accumulation schedule of a fitting ``plan``: the
    schedule ``schedule`` names ("auto": ``choose_schedule``'s pick), both estimates; as a dict for
    ``--json`` and as text lines."""
    chosen, estimates = choose_schedule(plan, micro_batches)
    if schedule != "auto":
        chosen = schedule
    record = dict(requested=schedule, chosen=chosen, micro_batches=micro_batches,
                  estimates={name: asdict(e) for name, e in estimates.items()})
    if micro_batches == 1:  # NOTE: one micro-batch: both schedules are the same step, one row says it
        lines = [f"schedule (1 micro-batch per step): {chosen} (the relay is the same with one micro-batch)"]
        shown = {chosen: estimates[chosen]}
    else:
        lines = [f"schedule ({micro_batches} micro-batches per step): {chosen}"
                 + (" (--schedule auto: the faster predicted)" if schedule == "auto" else "")]
        shown = estimates
    for name, e in shown.items():
        lines.append(f"  {name:<8} step {format_seconds(e.step_s)}, link H2D {format_bytes(e.h2d_bytes)}, "
                     f"D2H {format_bytes(e.d2h_bytes)} per step, saved block inputs "
                     f"{format_bytes(e.saved_input_bytes)} on the {e.activations}")
    return record, "\n".join(lines)
