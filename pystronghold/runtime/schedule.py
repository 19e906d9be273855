"""The schedule: which block is loaded into which slot, and when slots are released.

A pass uses blocks forward ``0 .. N-1`` and, when training, backward ``N-1 .. 0``. The plan,
computed once per (N, W, train), simulates W slots: after each use the resident set becomes the
next W distinct blocks to be used, so while block i computes blocks i+1 .. i+W-1 are loading, and
the last W blocks of forward stay for backward. Both backends run exactly this plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Use", "Load", "Release", "Plan", "build_plan", "plan_uses", "pass_uses"]


@dataclass(frozen=True, slots=True)
class Use:
    """One use of a block: ``phase`` is "fwd" or "bwd"."""

    phase: str
    block: int


@dataclass(frozen=True, slots=True)
class Load:
    """Copy ``block``'s parameters from the host store into ``slot``."""

    block: int
    slot: int


@dataclass(frozen=True, slots=True)
class Release:
    """``block`` leaves ``slot``; the slot is reused once its copy-out and compute are finished."""

    block: int
    slot: int


@dataclass(slots=True)
class Plan:
    """The precomputed actions of one pass."""

    uses: list[Use]
    """Block uses in execution order."""
    window: int
    """Slots W."""
    prologue: list[Load]
    """Loads issued before the first use."""
    after: list[list[Release | Load]] = field(default_factory=list)
    """``after[k]``: releases then loads to issue once use k has finished."""
    slot_at: list[int] = field(default_factory=list)
    """``slot_at[k]``: the slot holding the block of use k."""
    micro_batches: int = 1
    """Micro-batches each block use runs over in a row (the relay schedule, ``runtime/streaming/relay.py``):
    every use is repeated this many times, and the plan's actions follow the last of the repeats."""

    def run_bounds(self, k: int) -> tuple[bool, bool]:
        """(first, last): whether use k opens / closes its run of repeats of one (phase, block)."""
        uses = self.uses
        return k == 0 or uses[k - 1] != uses[k], k + 1 == len(uses) or uses[k + 1] != uses[k]

    def run_length(self, k: int) -> int:
        """Uses in the run of repeats of one (phase, block) that ends at use k (k its last)."""
        uses, start = self.uses, k
        while start > 0 and uses[start - 1] == uses[k]:
            start -= 1
        return k - start + 1

    def max_resident(self) -> int:
        """Largest number of blocks resident at once (loaded or loading) over the pass."""
        resident = len(self.prologue)
        peak = resident
        for actions in self.after:
            for a in actions:
                resident += 1 if isinstance(a, Load) else -1
                peak = max(peak, resident)
        return peak


def build_plan(n_blocks: int, window: int, train: bool, micro_batches: int = 1,
               blocks: list[int] | None = None) -> Plan:
    """Plan one pass over ``n_blocks`` blocks with ``window`` slots (1 <= window <= n_blocks);
    ``micro_batches`` > 1: each use repeated that many times in a row (layer-major, the relay);
    ``blocks``: the blocks this pass runs, in order (a layer-drop step skips the others; then
    ``window`` <= len(blocks)), default all ``n_blocks``."""
    order = list(range(n_blocks)) if blocks is None else list(blocks)
    if len(order) < 1:
        raise ValueError(f"build_plan: a pass needs >= 1 block, got n_blocks={n_blocks}, blocks={blocks}")
    if not 1 <= window <= len(order):
        raise ValueError(f"build_plan: window must be in [1, {len(order)}], got {window}")
    if micro_batches < 1:
        raise ValueError(f"build_plan: micro_batches must be >= 1, got {micro_batches}")
    uses = [Use("fwd", i) for i in order for _ in range(micro_batches)]
    if train:
        uses += [Use("bwd", i) for i in reversed(order) for _ in range(micro_batches)]
    return plan_uses(uses, window, micro_batches)


def pass_uses(passes: list[tuple[str, range]]) -> list[Use]:
    """The block uses of a sequence of passes, each ``(kind, blocks)``: "fwd" uses ``blocks`` in
    order, "bwd" in reverse. A pipeline stage runs several micro-batches' passes in its schedule's
    order (e.g. 1F1B: fwd fwd bwd fwd bwd bwd over all its blocks); an interleaved stage's passes
    each run one of its model chunks (a sub-range of its blocks; an empty range uses none). One plan
    over all of them keeps prefetching across passes."""
    uses: list[Use] = []
    for kind, blocks in passes:
        if kind not in ("fwd", "bwd"):
            raise ValueError(f"pass_uses: a pass is 'fwd' or 'bwd', got {kind!r}")
        uses += [Use(kind, i) for i in (blocks if kind == "fwd" else reversed(blocks))]
    return uses


def plan_uses(uses: list[Use], window: int, micro_batches: int = 1) -> Plan:
    """Plan ``uses`` (any sequence of block uses) with ``window`` slots, by the simulation above;
    ``micro_batches``: how many times in a row each use repeats (recorded on the plan)."""
    if not uses:
        raise ValueError("plan_uses: no block uses to plan")
    n_blocks = len({u.block for u in uses})
    if not 1 <= window <= n_blocks:
        raise ValueError(f"plan_uses: window must be in [1, {n_blocks}], got {window}")

    def next_distinct(k: int) -> list[int]:
        """The first `window` distinct blocks used from position k on, in order of use."""
        out: list[int] = []
        for u in uses[k:]:
            if u.block not in out:
                out.append(u.block)
                if len(out) == window:
                    break
        return out

    free = list(range(window))
    slot_of: dict[int, int] = {}
    plan = Plan(uses=uses, window=window, prologue=[], micro_batches=micro_batches)
    for b in next_distinct(0):
        slot_of[b] = free.pop(0)
        plan.prologue.append(Load(b, slot_of[b]))
    for k, use in enumerate(uses):
        plan.slot_at.append(slot_of[use.block])
        wanted = next_distinct(k + 1)
        actions: list[Release | Load] = []
        for b in sorted(set(slot_of) - set(wanted)):
            slot = slot_of.pop(b)
            free.append(slot)
            actions.append(Release(b, slot))
        for b in wanted:
            if b not in slot_of:
                slot_of[b] = free.pop(0)
                actions.append(Load(b, slot_of[b]))
        plan.after.append(actions)
    assert not slot_of, "every block is released by the end of a pass"
    return plan
