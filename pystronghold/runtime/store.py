"""The store: every block's parameters and optimizer state as flat per-block buffers.

Per state, host arenas (pinned on CUDA hosts) carved into one flat buffer per block: fp32
``master`` (the source of truth), ``exp_avg``, ``exp_avg_sq``, and in the compute dtype ``grad``
and (bf16/fp16 only) ``shadow``, the copy the next forward uploads. States over the host budget
live in the file tier (``placement.py`` decides, ``disk_tier.py`` stages). Offsets follow
``layout``; gaps are zero, so the fused Adam runs over whole buffers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from pystronghold.runtime.memory.disk_tier import DiskTier, Lease
from pystronghold.runtime.memory.layout import arena_bytes, buffer_bytes, param_offsets, state_dtype, upload_state
from pystronghold.runtime.memory.placement import Placement, plan_placement

__all__ = ["DEFAULT_CHUNK_BYTES", "ParamSpan", "BlockLayout", "HostStore", "Lease"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParamSpan:
    """Where one parameter lives inside its block's flat buffer (in elements)."""

    name: str
    """Name relative to the block, e.g. ``attn.qkv.weight``."""
    shape: torch.Size
    offset: int
    numel: int


def _span_views(flat: torch.Tensor, spans: list[ParamSpan]) -> list[torch.Tensor]:
    """One view per span of ``flat``, in its parameter's shape."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in spans]


class BlockLayout:
    """Offsets of a block's parameters in its flat buffers; ``numel`` is the padded total.

    ``named_params`` lists the trainable parameters first, then the frozen ones (``requires_grad``
    tells them apart; ValueError otherwise): the first ``trainable`` spans end before
    ``train_numel``, the padded size of the states that hold trainable parameters only.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
        flags = [bool(p.requires_grad) for _, p in named_params]
        self.trainable = sum(flags)
        """How many of the parameters (the first ones) are trainable."""
        if any(flags[self.trainable:]):
            raise ValueError("BlockLayout: list the trainable parameters before the frozen ones")
        offsets, self.numel = param_offsets([p.numel() for _, p in named_params])
        self.train_numel = offsets[self.trainable] if self.trainable < len(offsets) else self.numel
        """Padded elements of the trainable part (0 for a wholly frozen block; ``numel`` without
        frozen parameters)."""
        self.spans: list[ParamSpan] = [ParamSpan(name, p.shape, offset, p.numel())
                                       for (name, p), offset in zip(named_params, offsets)]
        # Ranges not covered by any parameter: kept at zero wherever a flat buffer is written.
        self.gaps: list[tuple[int, int]] = []
        end = 0
        for s in self.spans:
            if s.offset > end:
                self.gaps.append((end, s.offset))
            end = s.offset + s.numel
        if self.numel > end:
            self.gaps.append((end, self.numel))

    @property
    def frozen(self) -> int:
        """How many of the parameters (the last ones) are frozen."""
        return len(self.spans) - self.trainable

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per parameter (in the parameter's shape) into ``flat`` (>= numel elements)."""
        return _span_views(flat, self.spans)

    def train_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per trainable parameter into ``flat`` (>= train_numel elements)."""
        return _span_views(flat, self.spans[:self.trainable])

    def frozen_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per frozen parameter into ``flat`` (a whole block's buffer: numel elements)."""
        return _span_views(flat, self.spans[self.trainable:])

    def zero_gaps(self, flat: torch.Tensor) -> None:
        """Write zeros into the padding of ``flat`` (a whole block's buffer, or its trainable part)."""
        for start, end in self.gaps:
            flat[start:end].zero_()


DEFAULT_CHUNK_BYTES = 1 << 30
"""Most bytes of one host arena of the store (a block's buffer larger than this gets an arena of its
own). Smaller arenas let the pinning (``cudaHostRegister``, which faults in and locks every page)
proceed chunk by chunk while earlier chunks are already being filled."""


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One arena of one state: the consecutive blocks it holds and its capacity in bytes."""

    state: str
    blocks: tuple[int, ...]
    capacity: int


class HostStore:
    """Owns every block's states: host buffers per tier and, per ``placement``, the file tier.

    ``tiers[state][block]`` is a flat buffer carved from arenas of at most ``chunk_bytes`` (None when
    on disk; ``disk_factory(placement)`` makes the ``DiskTier``). Users go through
    ``acquire``/``release`` leases. ``arena_factory(capacity_bytes)`` makes zeroed HostArenas (pinned
    on CUDA). The caller planned the placement; this class allocates. With ``background=True`` a
    builder thread makes the arenas in block order; a lease waits for them and raises its error.
    """

    def __init__(self, layouts: list[BlockLayout], compute_dtype: torch.dtype, arena_factory, *,
                 placement: Placement | None = None, disk_factory=None,
                 chunk_bytes: int | None = None, background: bool = False) -> None:
        self.layouts = layouts
        self.compute_dtype = compute_dtype
        numels = [lay.numel for lay in layouts]
        train_numels = [lay.train_numel for lay in layouts]
        if placement is None:
            placement = plan_placement(numels, compute_dtype, budget_bytes=2**62, train_numels=train_numels)
        self.placement = placement
        self.state_numels = placement.numels
        """Elements of each state's buffer per block (``layout.state_numel``)."""
        self._arena_factory = arena_factory
        self.arenas: dict[str, list] = {state: [] for state in placement.states}
        # a state with no elements in a block (a frozen block's master, moments and gradient) is an
        # empty tensor: nothing reads or writes it
        self.tiers: dict[str, list[torch.Tensor | None]] = {
            s: [None if self.state_numels[s][b] else torch.empty(0, dtype=state_dtype(s, compute_dtype))
                for b in range(len(layouts))] for s in placement.states}
        chunk_bytes = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        chunks = []
        for state in placement.states:
            group, group_bytes = [], 0
            for b in range(len(layouts)):
                if placement.on_disk(state, b) or not self.state_numels[state][b]:
                    continue
                nbytes = buffer_bytes(self.state_numels[state][b], state, compute_dtype)
                if group and group_bytes + nbytes > chunk_bytes:
                    chunks.append(_Chunk(state, tuple(group), arena_bytes(group_bytes)))
                    group, group_bytes = [], 0
                group.append(b)
                group_bytes += nbytes
            if group:
                chunks.append(_Chunk(state, tuple(group), arena_bytes(group_bytes)))
        # block order (all states of block 0's chunks first): the order the fill needs them in
        self._chunks = sorted(chunks, key=lambda c: c.blocks[0])
        self._needed = [0] * len(layouts)  # block -> chunks that must be built before it is usable
        for i, chunk in enumerate(self._chunks):
            for b in chunk.blocks:
                self._needed[b] = i + 1
        self._cond = threading.Condition()
        self._built = 0  # chunks built so far, in order
        self._build_error: BaseException | None = None
        self._stop = False
        self.build_s = 0.0  # seconds the builder spent making arenas (mmap, pinning)
        # NOTE: the tier is built before the arenas, so a failure in either leaves no files once
        # close() ran (the engine closes the store and the scratch directory on any failure)
        self.disk: DiskTier | None = disk_factory(placement) if placement.spilled else None
        self.nbytes = (sum(c.capacity for c in self._chunks)
                       + (self.disk.arena.capacity_bytes if self.disk is not None else 0))
        self._builder = None
        if background and self._chunks:
            self._builder = threading.Thread(target=self._build_all, name="pystronghold-store-arenas",
                                             daemon=True)
            self._builder.start()
        else:
            self._build_all()
            if self._build_error is not None:
                if self.disk is not None:
                    self.disk.close()
                raise self._build_error
        log.info("host store: %d blocks, %.1f MiB in host memory over %d arenas; %s", len(layouts),
                 self.nbytes / 2**20, len(self._chunks) + (self.disk is not None),
                 placement.describe(len(layouts)))

    # ---- building the arenas

    def _build_all(self) -> None:
        t0 = time.perf_counter()
        try:
            for chunk in self._chunks:
                if self._stop:
                    raise RuntimeError("the store was closed while its arenas were being made")
                arena = self._arena_factory(chunk.capacity)
                dtype = state_dtype(chunk.state, self.compute_dtype)
                for b in chunk.blocks:
                    # NOTE: not zeroed here: a new arena's views are zero (fresh anonymous pages,
                    # never handed out twice), and zeroing would be a second pass over the store
                    self.tiers[chunk.state][b] = arena.allocate(f"{chunk.state}.{b}",
                                                                (self.state_numels[chunk.state][b],), dtype)
                with self._cond:
                    self.arenas[chunk.state].append(arena)
                    self._built += 1
                    self.build_s = time.perf_counter() - t0  # set before a waiter can see the last chunk
                    self._cond.notify_all()
        except BaseException as e:  # handed to whoever waits for a buffer
            with self._cond:
                self._build_error = e
                self._cond.notify_all()

    def wait_built(self, block: int | None = None) -> None:
        """Wait until the host buffers of ``block`` (None: of every block) exist; re-raises the
        builder's error (e.g. a failed pinning, or less host memory than planned)."""
        need = len(self._chunks) if block is None else self._needed[block]
        if self._built >= need:
            return
        with self._cond:
            while self._built < need and self._build_error is None:
                self._cond.wait()
            # NOTE: a later chunk's failure is not this block's: its buffers may all exist already
            if self._built < need:
                raise self._build_error

    @property
    def pinned(self) -> bool:
        """True when every host arena built so far is pinned (registered with CUDA)."""
        arenas = [a for per_state in self.arenas.values() for a in per_state]
        return bool(arenas) and all(a.pinned for a in arenas)

    @property
    def arena_count(self) -> int:
        """Host arenas of the block states (the file tier's cache not counted)."""
        return len(self._chunks)

    def tier_bytes(self) -> dict[str, int]:
        """Host bytes per state (and ``cache``, the file tier's staging cache), as allocated."""
        out = {state: sum(c.capacity for c in self._chunks if c.state == state)
               for state in self.placement.states}
        out = {state: n for state, n in out.items() if n}
        if self.disk is not None:
            out["cache"] = self.disk.arena.capacity_bytes
        return out

    def frozen_bytes(self) -> int:
        """Bytes of the store that hold frozen parameters: the upload state's frozen part of every
        block (padding between frozen parameters included; where it lives, host or disk, aside)."""
        itemsize = state_dtype(self.upload_state, self.compute_dtype).itemsize
        return sum((lay.numel - lay.train_numel) * itemsize for lay in self.layouts if lay.frozen)

    @property
    def has_shadow(self) -> bool:
        """True when a compute-precision shadow tier exists (bf16/fp16)."""
        return "shadow" in self.tiers

    @property
    def upload_state(self) -> str:
        """The state a load copies to the device, which alone holds the frozen parameters: the
        shadow in bf16/fp16, the master in fp32."""
        return upload_state(self.compute_dtype)

    def on_disk(self, state: str, block: int) -> bool:
        """True when ``state`` of ``block`` lives in the file tier."""
        return self.placement.on_disk(state, block)

    # ---- leases

    def acquire(self, block: int, states, *, fresh=(), modify=()) -> Lease:
        """Buffers of ``states`` of ``block`` (see ``DiskTier.acquire``): host buffers directly,
        disk states staged in the cache (call ``lease.wait()`` before reading them)."""
        if self._built < self._needed[block]:
            self.wait_built(block)
        ram = {s: self.tiers[s][block] for s in states if self.tiers[s][block] is not None}
        disk = [s for s in states if s not in ram]
        if not disk:
            return Lease(block, ram)
        lease = self.disk.acquire(block, disk, fresh=[s for s in fresh if s in disk],
                                  modify=[s for s in modify if s in disk])
        lease.tensors.update(ram)
        return lease

    def release(self, lease: Lease, *, dirty=(), after=(), drop=()) -> None:
        """Give ``lease`` back: its changed (``dirty``) disk states are written back behind the
        copies in ``after``; ``drop`` states are forgotten by the cache."""
        if lease.slot is not None:
            self.disk.release(lease, dirty=[s for s in dirty if s in lease.disk_states], after=after,
                              drop=[s for s in drop if s in lease.disk_states])

    def prefetch(self, block: int, states) -> None:
        """Start reading the disk states among ``states`` of ``block`` (never blocks once built)."""
        if self._built < self._needed[block]:
            self.wait_built(block)
        disk = [s for s in states if self.tiers[s][block] is None]
        if disk:
            self.disk.prefetch(block, disk)

    # ---- whole values (checkpoints, tests, exports)

    @torch.no_grad()
    def fill_from(self, block: int, params: list[torch.Tensor]) -> None:
        """Copy a block's initial parameter values (layout order) into its buffers: the trainable
        ones into the master (and shadow), the frozen ones into the upload state."""
        states = ["master", "shadow"] if self.has_shadow else ["master"]
        lease = self.acquire(block, states, fresh=states)
        layout, t = self.layouts[block], lease.tensors
        for state in states:
            layout.zero_gaps(t[state])  # every other element is written below
        for view, p in zip(layout.train_views(t["master"]), params[:layout.trainable]):
            view.copy_(p.detach())
        if self.has_shadow:
            t["shadow"][:layout.train_numel].copy_(t["master"])
        for view, p in zip(layout.frozen_views(t[self.upload_state]), params[layout.trainable:]):
            view.copy_(p.detach())  # rounded to the compute dtype: stored once, as it computes
        self.release(lease, dirty=states)

    def read_state(self, block: int, state: str) -> torch.Tensor:
        """The flat value of ``state`` of ``block``: the host buffer itself, or a copy read from disk."""
        lease = self.acquire(block, [state])
        try:
            lease.wait()
            value = lease.tensors[state] if lease.slot is None else lease.tensors[state].clone()
        finally:
            self.release(lease)
        return value

    @torch.no_grad()
    def write_state(self, block: int, state: str, values: list[torch.Tensor]) -> None:
        """Overwrite the trainable part of ``state`` of ``block`` with one tensor per trainable
        parameter (gaps stay zero; the upload state's frozen part is kept)."""
        layout = self.layouts[block]
        if len(values) != layout.trainable:
            raise ValueError(f"write_state: block {block} has {layout.trainable} trainable parameters, "
                             f"got {len(values)} {state} tensors")
        self._write(block, state, layout.train_views, values)

    @torch.no_grad()
    def write_frozen(self, block: int, values: list[torch.Tensor]) -> None:
        """Overwrite the frozen parameters of ``block`` (one tensor each, layout order; cast to the
        compute dtype) in the upload state."""
        layout = self.layouts[block]
        if len(values) != layout.frozen:
            raise ValueError(f"write_frozen: block {block} has {layout.frozen} frozen "
                             f"parameters, got {len(values)} tensors")
        self._write(block, self.upload_state, layout.frozen_views, values)

    def _write(self, block: int, state: str, views_of, values: list[torch.Tensor]) -> None:
        # NOTE: a lease that keeps the rest of the buffer (a frozen part beside a trainable one)
        # reads it first; one that covers the whole buffer does not
        whole = state != self.upload_state or len(values) == len(self.layouts[block].spans)
        lease = self.acquire(block, [state], fresh=[state] if whole else (), modify=() if whole else [state])
        lease.wait()
        flat = lease.tensors[state]
        # NOTE: values may be views of this very buffer (a state dict loaded back): copy, then zero
        # only the gaps
        for view, v in zip(views_of(flat), values):
            view.copy_(v)
        self.layouts[block].zero_gaps(flat)
        self.release(lease, dirty=[state])

    def frozen_values(self, block: int) -> list[torch.Tensor]:
        """The frozen parameters of ``block`` (layout order) in the compute dtype: views of the host
        buffer, or of a copy read from disk."""
        if not self.layouts[block].frozen:
            return []
        return self.layouts[block].frozen_views(self.read_state(block, self.upload_state))

    # ---- the file tier as a whole

    def synchronize(self) -> None:
        """Wait for the file tier's reads and writes in flight (raises its first failure)."""
        if self.disk is not None:
            self.disk.synchronize()

    def take_events(self) -> list:
        """File reads/writes issued since the last call, for the trace."""
        return self.disk.take_events() if self.disk is not None else []

    def disk_stats(self) -> dict | None:
        """The file tier's counters (None without one)."""
        return self.disk.stats() if self.disk is not None else None

    def close(self) -> None:
        """Stop making arenas (if still at it), finish the file tier's I/O and close its files."""
        self._stop = True
        if self._builder is not None:
            self._builder.join()
        if self.disk is not None:
            self.disk.close()
