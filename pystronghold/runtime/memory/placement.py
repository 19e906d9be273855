"""Which block states live in host memory and which in the file (NVMe) tier.

Without a disk directory every state is in host memory and a store larger than the budget is
refused. With one, states move to disk, least harmful first (a streamed ``grad``, ``exp_avg_sq``,
``exp_avg``, ``master``, a non-streamed ``grad``, ``shadow``), last blocks first within a state,
until the host part, the block cache (``cache_blocks`` blocks of every state with any block on
disk) and the fixed costs fit the budget.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pystronghold.runtime.memory.layout import STATES, buffer_bytes, state_numel, stored_states

__all__ = ["Placement", "plan_placement", "spill_order", "available_host_bytes", "DEFAULT_HOST_FRACTION",
           "default_host_budget_bytes"]


def available_host_bytes() -> int:
    """Host memory the store may use, in bytes: MemAvailable from /proc/meminfo (Linux), else all RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


DEFAULT_HOST_FRACTION = 0.85
"""Share of the available host memory the store may use when no budget is given: the rest is left
for activations, the loss, Python and torch (a store filled to the last byte would be OOM-killed)."""


def default_host_budget_bytes() -> int:
    """The host budget of a store when ``host_memory_bytes`` is not given, in bytes."""
    return int(available_host_bytes() * DEFAULT_HOST_FRACTION)


def spill_order(compute_dtype: torch.dtype, *, streamed_grads: bool) -> tuple[str, ...]:
    """The order in which states move to disk (see the module docstring)."""
    order = ["exp_avg_sq", "exp_avg", "master", "grad"]
    if streamed_grads:
        order = ["grad"] + order[:-1]
    if compute_dtype != torch.float32:
        order.append("shadow")
    return tuple(order)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each (state, block) lives, and the byte totals that decided it."""

    states: tuple[str, ...]
    """States the store holds (``shadow`` only in bf16/fp16)."""
    compute_dtype: torch.dtype = torch.float32
    """The dtype of grad and shadow."""
    numels: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """State -> elements of its buffer in each block (``layout.state_numel``: the upload state
    holds the whole block, the others its trainable part)."""
    disk_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """State -> blocks whose record of that state is on disk (absent: all in host memory)."""
    cache_blocks: int = 0
    """Blocks the host cache stages at once (0 when nothing is on disk)."""
    streamed_grads: bool = False
    """Gradients on disk go straight from the copy-out to the update, never to a file."""
    host_bytes: int = 0
    """Bytes of the host-memory part of the store, cache included."""
    cache_bytes: int = 0
    """Bytes of the cache (part of ``host_bytes``)."""
    disk_bytes: int = 0
    """Bytes of the records on disk (streamed gradients excluded: they never reach a file)."""
    budget_bytes: int = 0
    """The host budget the placement was made for (store + ``fixed_bytes``)."""
    fixed_bytes: int = 0
    """Host bytes outside the store counted against the budget (the CPU backend's device arena)."""

    def on_disk(self, state: str, block: int) -> bool:
        """True when ``state`` of ``block`` lives in the file tier."""
        return block in self.disk_blocks.get(state, ())

    @property
    def spilled(self) -> bool:
        """True when any state of any block is on disk."""
        return any(self.disk_blocks.values())

    @property
    def disk_states(self) -> tuple[str, ...]:
        """States with at least one block on disk, in ``STATES`` order."""
        return tuple(s for s in STATES if self.disk_blocks.get(s))

    def step_io_bytes(self, numels: list[int], train_numels: list[int] | None = None) -> int:
        """Disk bytes read plus written in one training step (an upper bound: cache hits save
        some): each update reads and writes its disk states (a non-streamed gradient is written at
        the copy-out and read by the update), and a load reads its upload state (fp32 master or
        shadow) for the forward and again for the backward. ``train_numels``: the trainable part
        of each block (default: all of it; see ``plan_placement``)."""
        total = 0
        upload = "shadow" if "shadow" in self.states else "master"
        train_numels = numels if train_numels is None else train_numels
        for state, blocks in self.disk_blocks.items():
            if state == "grad" and self.streamed_grads:
                continue
            for b in blocks:
                # a load reads the whole upload state; the update reads and writes the trainable part
                loads = 2 * buffer_bytes(numels[b], state, self.compute_dtype) if state == upload else 0
                update = (1 if state == "shadow" else 2) * buffer_bytes(train_numels[b], state, self.compute_dtype)
                total += loads + update
        return total

    def describe(self, n_blocks: int) -> str:
        """One line: which states are on disk (all blocks or how many)."""
        if not self.spilled:
            return "all states in host memory"
        parts = []
        for s in self.disk_states:
            k = len(self.disk_blocks[s])
            what = "streamed" if s == "grad" and self.streamed_grads else "on disk"
            parts.append(f"{s} {what}" + ("" if k == n_blocks else f" ({k}/{n_blocks} blocks)"))
        return (f"{', '.join(parts)}; host {self.host_bytes / 2**30:.2f} GiB incl. cache of "
                f"{self.cache_blocks} blocks ({self.cache_bytes / 2**30:.2f} GiB), disk "
                f"{self.disk_bytes / 2**30:.2f} GiB")


def plan_placement(numels: list[int], compute_dtype: torch.dtype, *, budget_bytes: int,
                   fixed_bytes: int = 0, nvme: bool = False, cache_blocks: int = 4,
                   streamed_grads: bool = False, force_disk: bool = False,
                   budget_is_limit: bool = False, train_numels: list[int] | None = None) -> Placement:
    """Place the states of blocks with ``numels`` (padded elements per block) for a host budget.

    ``budget_bytes``: host bytes for the store plus ``fixed_bytes``; ``nvme``: a disk directory
    exists; ``cache_blocks``: blocks staged at once; ``streamed_grads``: gradients go straight to the
    update; ``force_disk``: spill everything; ``budget_is_limit``: the user set the budget (errors say
    so); ``train_numels``: trainable elements per block (default ``numels``). Raises MemoryError with
    the numbers when no placement fits.
    """
    if cache_blocks < 1:
        raise ValueError(f"cache_blocks must be >= 1, got {cache_blocks}")
    n = len(numels)
    states = stored_states(compute_dtype)
    train_numels = numels if train_numels is None else train_numels

    def each(size, values) -> list[int]:
        # NOTE: the planner places tens of thousands of blocks, most of one size: each size is sized once
        memo = {}
        return [memo[v] if v in memo else memo.setdefault(v, size(v)) for v in values]

    sizes = {s: each(lambda kt, s=s: state_numel(s, *kt, compute_dtype), zip(numels, train_numels)) for s in states}
    per = {s: each(lambda k, s=s: buffer_bytes(k, s, compute_dtype), sizes[s]) for s in states}
    slot = {s: buffer_bytes(max(sizes[s], default=0), s, compute_dtype) for s in states}
    ram = sum(sum(v) for v in per.values())
    sizes = {s: tuple(v) for s, v in sizes.items()}
    if ram + fixed_bytes <= budget_bytes and not force_disk:
        return Placement(states=states, compute_dtype=compute_dtype, numels=sizes, host_bytes=ram,
                         budget_bytes=budget_bytes, fixed_bytes=fixed_bytes)
    if not nvme:
        total = ram + fixed_bytes
        raise MemoryError(
            f"wrap: the host store needs {total:,} bytes ({total / 2**30:.3f} GiB: states {ram:,}, device "
            f"arena (host memory on device='cpu') {fixed_bytes:,}) for {n} blocks, but "
            f"{_budget_words(budget_bytes, budget_is_limit)}; nothing was allocated. "
            + ("Raise the limit, give" if budget_is_limit else "Give")
            + " an NVMe directory (--nvme DIR / nvme_dir=) so states can live on disk, "
            + ("or use a smaller model." if budget_is_limit
               else "use a smaller model, or a host with more memory."))
    order = [s for s in spill_order(compute_dtype, streamed_grads=streamed_grads) if s in states]
    disk: dict[str, list[int]] = {}
    cache = 0
    for state in order:
        for block in reversed(range(n)):
            if ram + cache + fixed_bytes <= budget_bytes and not force_disk:
                break
            if not per[state][block]:
                continue  # nothing of this state in this block (a frozen block's moments)
            if state not in disk:
                disk[state] = []
                cache += cache_blocks * slot[state]
            disk[state].append(block)
            ram -= per[state][block]
    host = ram + cache
    if host + fixed_bytes > budget_bytes:
        raise MemoryError(
            f"even with every state on disk the host needs {host + fixed_bytes:,} bytes "
            f"({(host + fixed_bytes) / 2**30:.2f} GiB: cache of {cache_blocks} blocks {cache:,}, "
            f"device arena {fixed_bytes:,}, rest of the store {ram:,}), but "
            f"{_budget_words(budget_bytes, budget_is_limit)}; give more --host-memory, fewer "
            "cache blocks, or use a model with smaller blocks.")
    disk_bytes = sum(per[s][b] for s, blocks in disk.items() for b in blocks
                     if not (s == "grad" and streamed_grads))
    return Placement(states=states, compute_dtype=compute_dtype, numels=sizes,
                     disk_blocks={s: tuple(sorted(b)) for s, b in disk.items()},
                     cache_blocks=cache_blocks, streamed_grads=streamed_grads and "grad" in disk,
                     host_bytes=host, cache_bytes=cache, disk_bytes=disk_bytes,
                     budget_bytes=budget_bytes, fixed_bytes=fixed_bytes)


def _budget_words(budget_bytes: int, is_limit: bool) -> str:
    """What the host budget is, in words, with the host's own figure when the user set the limit."""
    host = available_host_bytes()
    if is_limit:
        return (f"the host memory limit you set (--host-memory / host_memory_bytes=) is {budget_bytes:,} bytes "
                f"({budget_bytes / 2**30:.3f} GiB); the host has {host:,} bytes ({host / 2**30:.3f} GiB) "
                "available")
    return (f"the host has {host:,} bytes ({host / 2**30:.3f} GiB) available, of which the store may use "
            f"{budget_bytes:,} bytes ({DEFAULT_HOST_FRACTION:.0%}; set --host-memory / host_memory_bytes= "
            "to change that)")
