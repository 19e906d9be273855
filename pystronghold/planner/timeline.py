"""Step time of the window schedule, by simulating its lanes, and the choice of W.

The simulation follows ``pystronghold.runtime.streaming.schedule`` (W slots, forward 0 .. N-1, backward
N-1 .. 0, the last W blocks resident for backward) on five serial lanes running concurrently:
compute, H2D loads, the data-parallel all-reduce, D2H gradient copy-outs and the CPU Adam. K
device-resident blocks (``pystronghold.runtime.optimizer.resident``) have no loads or host updates and run
their AdamW on the compute lane. Three steps are simulated and the last is measured, so host
updates delaying the next step's loads count. O(N) per simulation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pystronghold.planner.cost import BlockCosts

__all__ = ["StepTime", "simulate_step", "choose_window", "resident_bwd_s", "with_sequence_costs"]


@dataclass(frozen=True, slots=True)
class StepTime:
    """One training step on one rank, seconds: ``total = compute + exposed_transfer + exposed_optimizer``."""

    total_s: float
    """Wall time of one step in steady state."""
    compute_s: float
    """Compute alone: N * (forward + backward) + loss, plus the device AdamW of resident blocks."""
    exposed_transfer_s: float
    """Time the compute waits for copies and collectives (step time without host updates, minus compute)."""
    exposed_optimizer_s: float
    """Time the host updates add on top (step time minus the step time with free host updates)."""


def resident_bwd_s(c: BlockCosts, resident_recompute: bool) -> float:
    """Backward of one resident block, seconds: ``bwd_s`` without its recompute unless it recomputes."""
    return c.bwd_s if resident_recompute else c.bwd_s - c.recompute_s


def _run(c: BlockCosts, n: int, w: int, overlap: str, steps: int, resident: int = 0,
         resident_recompute: bool = False) -> float:
    """Duration of the last of ``steps`` simulated steps, seconds (blocks < ``resident`` resident)."""
    # NOTE: the planner simulates tens of thousands of blocks hundreds of times (largest_models), so
    # the costs are locals and ``max(a, b)`` is written ``b if b > a else a`` (what max computes, the
    # same floats) without the call
    r = resident
    w = min(w, n - r)
    r_bwd = resident_bwd_s(c, resident_recompute)
    fwd_s, bwd_s, load_s, adam_s = c.fwd_s, c.bwd_s, c.load_s, c.adam_s
    allreduce_s, grad_s = c.allreduce_s, c.grad_s
    on_backward = overlap == "backward"
    comp = h2d = coll = d2h = cpu = 0.0  # when each lane is next free
    update_done = [0.0] * n  # when each block's latest host update ends
    ends = [0.0]
    for _ in range(steps):
        start = comp
        loaded = [0.0] * n  # forward load of block k ends
        fwd_done = [0.0] * n
        for k in range(n):
            if k < r:  # resident: nothing to load
                comp += fwd_s
                fwd_done[k] = comp
                continue
            issue = start if k - r < w else fwd_done[k - w]  # prologue, or the slot block k - w left
            if issue > h2d:
                h2d = issue
            done = update_done[k]
            if done > h2d:
                h2d = done
            h2d += load_s
            loaded[k] = h2d
            if h2d > comp:
                comp = h2d
            comp += fwd_s
            fwd_done[k] = comp
        comp += c.head_tail_s  # loss forward + backward (head backward is negligible)
        grad_out = [0.0] * n  # gradient copy-out of block j ends
        for j in range(n - 1, -1, -1):
            if j < r:
                comp += r_bwd
                continue
            if j >= n - w:
                ready = loaded[j]  # still resident from forward
            else:
                out = grad_out[j + w]  # reuse the slot of block j + w
                if out > h2d:
                    h2d = out
                h2d += load_s
                ready = h2d
            if ready > comp:
                comp = ready
            comp += bwd_s
            if comp > coll:
                coll = comp
            coll += allreduce_s
            if coll > d2h:
                d2h = coll
            d2h += grad_s
            grad_out[j] = d2h
            if on_backward:
                if d2h > cpu:
                    cpu = d2h
                cpu += adam_s
                update_done[j] = cpu
        backward_end = comp
        comp += r * c.device_adam_s  # the resident blocks' device AdamW, in step()
        if overlap == "forward" and r < n:
            # the global gradient (norm, overflow check) first: step() reads the norm, which needs
            # every gradient, the resident blocks' too, then submits the host updates (the device
            # AdamW runs meanwhile)
            cpu = max(cpu, d2h, backward_end)
            for k in range(r, n):
                cpu += adam_s
                update_done[k] = cpu
        ends.append(comp)
    return ends[-1] - ends[-2]


def simulate_step(costs: BlockCosts, n_blocks: int, window: int, overlap: str = "backward",
                  steps: int = 3, *, resident: int = 0, resident_recompute: bool = False) -> StepTime:
    """Steady-state step time of ``n_blocks`` blocks with a window of ``window`` slots, seconds;
    ``resident``: K, the first K blocks device-resident (``window`` may be 0 when K = N)."""
    if not 0 <= resident <= n_blocks:
        raise ValueError(f"simulate_step: resident must be in [0, {n_blocks}], got {resident}")
    if n_blocks < 1 or window < (1 if resident < n_blocks else 0):
        raise ValueError(f"simulate_step: n_blocks and window must be >= 1, got {n_blocks}, {window}")
    split = dict(resident=resident, resident_recompute=resident_recompute)
    total = _run(costs, n_blocks, window, overlap, steps, **split)
    no_opt = _run(replace(costs, adam_s=0.0), n_blocks, window, overlap, steps, **split)
    compute = ((n_blocks - resident) * (costs.fwd_s + costs.bwd_s) + costs.head_tail_s
               + resident * (costs.fwd_s + resident_bwd_s(costs, resident_recompute) + costs.device_adam_s))
    return StepTime(total_s=total, compute_s=compute, exposed_transfer_s=max(0.0, no_opt - compute),
                    exposed_optimizer_s=max(0.0, total - no_opt))


def choose_window(costs: BlockCosts, n_blocks: int, max_window: int, overlap: str = "backward",
                  tolerance: float = 0.01, *, resident: int = 0, resident_recompute: bool = False
                  ) -> tuple[int, StepTime]:
    """The smallest W in [1, max_window] whose step time is within ``tolerance`` (relative) of the best
    any W <= max_window reaches, with and without host updates; returns W and its step time.

    Where transfers hide behind compute this is the smallest W that hides them; link-bound, it is
    where larger windows stop helping. Binary search (step time does not increase with W). With
    ``resident`` = K the slots serve the N - K streamed blocks (W = 0 when K = N).
    """
    split = dict(resident=resident, resident_recompute=resident_recompute)
    if resident == n_blocks:
        return 0, simulate_step(costs, n_blocks, 0, overlap, **split)
    if max_window < 1:
        raise ValueError(f"choose_window: max_window must be >= 1, got {max_window}")
    hi = min(max_window, n_blocks - resident)
    best = simulate_step(costs, n_blocks, hi, overlap, **split)

    def good(t: StepTime) -> bool:
        return (t.total_s <= best.total_s * (1 + tolerance)
                and t.compute_s + t.exposed_transfer_s
                <= (best.compute_s + best.exposed_transfer_s) * (1 + tolerance))

    lo, found = 1, (hi, best)
    while lo < hi:
        mid = (lo + hi) // 2
        t = simulate_step(costs, n_blocks, mid, overlap, **split)
        if good(t):
            hi, found = mid, (mid, t)
        else:
            lo = mid + 1
    return found


def with_sequence_costs(step: StepTime, costs: BlockCosts, offloaded: int, *, input_disk_bytes: int = 0,
                        disk_step_bytes: int = 0, nvme_bytes_per_s: float = 0.0) -> StepTime:
    """``step`` plus what the sequence settings expose, outside the simulated lanes (an estimate
    per block, not a simulation):

    - ``offloaded`` blocks' inputs go out on the D2H lane during their forward (exposed where one
      copy outlasts a block's forward) and come back on the H2D lane behind the block's weight load
      during backward (exposed where load + input outlast a block's backward, beyond what the load
      alone exposes); with inputs on the NVMe tier, their disk reads and writes beside the store's
      (``disk_step_bytes``) beyond the step's compute;
    - head and tail on the host: their update between backward and the next forward
      (``costs.head_tail_update_s``), all of it exposed.
    """
    c = costs
    exposed = 0.0
    if offloaded:
        exposed += offloaded * max(0.0, c.input_copy_s - c.fwd_s)
        exposed += offloaded * (max(0.0, c.load_s + c.input_copy_s - c.bwd_s) - max(0.0, c.load_s - c.bwd_s))
    if input_disk_bytes and nvme_bytes_per_s:
        disk = disk_step_bytes / nvme_bytes_per_s
        exposed += (max(0.0, disk + 2 * input_disk_bytes / nvme_bytes_per_s - step.compute_s)
                    - max(0.0, disk - step.compute_s))
    return replace(step, total_s=step.total_s + exposed + c.head_tail_update_s,
                   exposed_transfer_s=step.exposed_transfer_s + exposed,
                   exposed_optimizer_s=step.exposed_optimizer_s + c.head_tail_update_s)
