"""The file (NVMe) tier of the store: block states on disk, staged through a bounded host cache.

One ``FileStore`` per disk state and a cache of ``cache_blocks`` slots. ``acquire(block, states)``
returns a ``Lease`` on the block's slot (LRU eviction; reads are asynchronous, ``Lease.wait()``;
never-written states read as zeros). ``release(lease, dirty=...)`` writes back asynchronously;
``prefetch`` never blocks. Failures raise ``DiskTierError`` naming directory, state and block, at
the latest at ``synchronize()``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from pathlib import Path

import torch

from pystronghold.io import CopyError, CopyHandle, FileStore, HostArena
from pystronghold.io.scratch import ScratchDir, check_free_space, free_bytes
from pystronghold.runtime.memory.layout import ARENA_ALIGN, arena_bytes, buffer_bytes, state_dtype
from pystronghold.runtime.memory.placement import Placement

__all__ = ["DiskTier", "DiskTierError", "Lease", "disk_tier_bytes", "open_scratch"]

log = logging.getLogger(__name__)


class DiskTierError(OSError):
    """A read or write of the NVMe tier failed (disk full, I/O error, corrupt record); the message
    names the directory, the state and the block."""


def disk_tier_bytes(placement: Placement) -> int:
    """Bytes the tier's files take on disk (what the preallocation reserves)."""
    return sum(FileStore.file_bytes_for(len(blocks), buffer_bytes(max(placement.numels[state]), state,
                                                                  placement.compute_dtype))
               for state, blocks in placement.disk_blocks.items()
               if blocks and not (state == "grad" and placement.streamed_grads))


def open_scratch(nvme_dir: str, need_bytes: int, *, preallocate: bool) -> ScratchDir:
    """The tier's scratch directory under ``nvme_dir``, after checking the disk has ``need_bytes``
    free: DiskSpaceError with both numbers when the files are to be preallocated, a warning when
    they grow sparse (the run then fails at the write that finds the disk full)."""
    if preallocate:
        check_free_space(nvme_dir, need_bytes, what="the NVMe tier's block states")
    else:
        free = free_bytes(nvme_dir)
        if free < need_bytes:
            log.warning("NVMe tier: %s has %s bytes free, the tier's files will grow to %s bytes "
                        "(sparse, not reserved): the run fails when the disk fills up",
                        nvme_dir, f"{free:,}", f"{need_bytes:,}")
    return ScratchDir(nvme_dir)


class _Slot:
    """One cache slot: a host buffer per disk state, and the block it holds."""

    def __init__(self, index: int, buffers: dict[str, torch.Tensor]) -> None:
        self.index = index
        self.buffers = buffers
        self.block: int | None = None
        self.valid: set[str] = set()  # states whose buffer holds the block's current value
        self.users = 0  # leases not released yet
        self.stamp = 0  # last use, for LRU eviction
        self.reads: dict[str, CopyHandle] = {}  # state -> read in flight into its buffer
        self.writes: dict[str, CopyHandle] = {}  # state -> write-back of its buffer
        self.readers: list = []  # copies reading the buffers (h2d): finish before reuse
        # state -> (copies the file engine cannot wait on, engine handles) a write-back waits for
        self.deferred: dict[str, tuple[list, list[CopyHandle]]] = {}


class Lease:
    """The buffers of one block's states, from ``HostStore.acquire``. ``tensors[state]`` is a flat
    tensor of the block's ``numel`` elements; ``wait()`` returns once their reads have finished."""

    __slots__ = ("block", "tensors", "slot", "reads", "disk_states", "_tier")

    def __init__(self, block: int, tensors: dict[str, torch.Tensor], slot=None, reads=(), tier=None) -> None:
        self.block = block
        self.tensors = tensors
        self.slot = slot
        self.reads = list(reads)  # (state, handle)
        self.disk_states = frozenset(tensors) if slot is not None else frozenset()  # staged in the slot
        self._tier = tier

    def wait(self) -> None:
        """Wait for the lease's disk reads (DiskTierError naming the file on failure)."""
        for state, handle in self.reads:
            self._tier._wait(handle, f"reading {state} of block {self.block}")
        self.reads = []

    def read_handles(self) -> list[CopyHandle]:
        """Handles of the reads still in flight (for ``after=`` of a copy from these buffers)."""
        return [h for _, h in self.reads]


class DiskTier:
    """Records of the disk-placed states and the host cache that stages them (see module doc).

    directory: an empty scratch directory (``pystronghold.io.ScratchDir``). engine, read_queue,
    write_queue: the copy engine and queues for file reads and writes (the CPU backend's engine,
    so a load can name a read in ``after=``). preallocate: reserve the disk space at creation.
    """

    def __init__(self, directory: Path, placement: Placement, compute_dtype: torch.dtype,
                 *, engine, read_queue: int, write_queue: int, arena_factory=None,
                 preallocate: bool = True) -> None:
        self.directory = Path(directory)
        self.placement = placement
        self.numels = placement.numels  # state -> elements per block
        self.dtype = compute_dtype
        self._engine, self._read_q, self._write_q = engine, read_queue, write_queue
        cap = {s: max(self.numels[s]) for s in placement.disk_states}  # a record holds the largest block
        self.states = placement.disk_states
        self._record: dict[str, dict[int, int]] = {
            s: {b: i for i, b in enumerate(placement.disk_blocks[s])} for s in self.states}
        self._files: dict[str, FileStore] = {}
        try:
            for state in self.states:
                if state == "grad" and placement.streamed_grads:
                    continue  # streamed: straight from the copy-out to the update, never a file
                self._files[state] = FileStore.create(
                    self.directory / state, num_blocks=len(placement.disk_blocks[state]),
                    record_bytes={state: buffer_bytes(cap[state], state, compute_dtype)}, engine=engine,
                    preallocate=preallocate)
        except (RuntimeError, OSError) as e:
            self._close_files()
            raise DiskTierError(f"NVMe tier {self.directory}: cannot create the state files: {e}") from e
        slot_bytes = sum(buffer_bytes(cap[s], s, compute_dtype) for s in self.states)
        factory = arena_factory or (lambda n: HostArena(int(n), alignment=ARENA_ALIGN, pin="none"))
        self.arena = factory(arena_bytes(placement.cache_blocks * slot_bytes))
        self._slots = []
        for i in range(placement.cache_blocks):
            bufs = {}
            for s in self.states:
                dt = state_dtype(s, compute_dtype)
                bufs[s] = self.arena.allocate(f"cache{i}.{s}", (buffer_bytes(cap[s], s, compute_dtype) // dt.itemsize,),
                                              dt)
                bufs[s].zero_()
            self._slots.append(_Slot(i, bufs))
        self._by_block: dict[int, _Slot] = {}
        self._written: dict[str, set[int]] = {s: set() for s in self.states}
        self._cond = threading.Condition()
        self._clock = itertools.count(1)
        self._events: list[tuple[str, int, CopyHandle]] = []
        self._failed: DiskTierError | None = None
        self.counters = dict(read_bytes=0, write_bytes=0, reads=0, writes=0, hits=0, misses=0,
                             zero_fills=0, evict_wait_s=0.0)
        log.info("NVMe tier in %s: %s", self.directory, placement.describe(len(self.numels[self.states[0]])))

    # ---- leases

    def acquire(self, block: int, states, *, fresh=(), modify=()) -> Lease:
        """Stage ``states`` (disk states of ``block``) in a cache slot; may wait for a free slot.

        fresh: states the caller overwrites completely (not read). modify: states the caller
        changes in place (their pending write-backs are waited for first). Release the lease with
        ``release`` once done.
        """
        self._raise_failed()
        with self._cond:
            self._issue_deferred()
            slot = self._slot_for(block, blocking=True)
            slot.users += 1
            slot.stamp = next(self._clock)
            overwritten = [slot.reads[s] for s in fresh if s in slot.reads]  # a prefetch into a fresh buffer
            reads = self._stage(slot, block, states, fresh)
            changed = set(fresh) | set(modify)
            deferred = [h for s in changed if s in slot.deferred for h in slot.deferred[s][0]]
        for handle in overwritten:
            self._wait(handle, f"prefetching block {block}")
        if deferred:  # the buffer is about to change: its deferred write-back must start first
            for h in deferred:
                h.wait()
            with self._cond:
                self._issue_deferred(slot)
        for state in changed:
            if state in slot.writes:
                self._wait(slot.writes[state], f"writing {state} of block {block}")
        if fresh or modify:
            for h in slot.readers:
                h.wait()
        return Lease(block, {s: slot.buffers[s][:self.numels[s][block]] for s in states}, slot, reads, self)

    def release(self, lease: Lease, *, dirty=(), after=(), drop=()) -> None:
        """Return ``lease``; write its ``dirty`` states back (after the ``after`` copies finish).

        after: copies that read or fill the lease's buffers (they must finish before the slot is
        reused; dirty writes start after them). drop: states whose buffers no longer hold the
        block's value (a streamed gradient once consumed).
        """
        slot: _Slot = lease.slot
        deps, device = [], []
        for h in after:
            if h is None:
                continue
            # NOTE: a CUDA copy's event: the file engine cannot wait on it, and the host must not
            # (that would be a device sync per block); the write-back is deferred until it is done
            (deps if isinstance(h, CopyHandle) else device).append(h)
        with self._cond:
            try:
                self._issue_deferred()
                slot.readers = [h for h in slot.readers if not h.done()] + deps + device
                for state in dirty:
                    if state not in self._files:
                        continue  # streamed gradient: never written
                    if device or state in slot.deferred:
                        waits, engine_deps = slot.deferred.get(state, ([], []))
                        slot.deferred[state] = (waits + device, engine_deps + deps)
                        slot.valid.add(state)  # the buffer holds the value once the copies are done
                        self._written[state].add(lease.block)
                    else:
                        self._write(slot, state, deps)
                self._issue_deferred(slot)
                for state in drop:
                    slot.valid.discard(state)
            finally:
                slot.users -= 1
                self._cond.notify_all()

    def prefetch(self, block: int, states) -> bool:
        """Start reading ``states`` of ``block`` into a free slot; never blocks. True if staged."""
        if self._failed is not None:
            return False
        with self._cond:
            self._issue_deferred()
            slot = self._slot_for(block, blocking=False)
            if slot is None:
                return False
            slot.stamp = next(self._clock)
            self._stage(slot, block, [s for s in states if block in self._written.get(s, ())], ())
        return True

    # ---- internals (called with self._cond held unless said otherwise)

    def _slot_for(self, block: int, *, blocking: bool) -> _Slot | None:
        slot = self._by_block.get(block)
        if slot is not None:
            self.counters["hits"] += blocking
            return slot
        while True:
            free = [s for s in self._slots if s.users == 0]
            if not blocking:
                free = [s for s in free if self._quiet(s)]
            if free:
                victim = min(free, key=lambda s: (s.block is not None, s.stamp))
                break
            if not blocking:
                return None
            self._cond.wait()
        t0 = time.monotonic()
        for waits, _ in victim.deferred.values():
            for h in waits:
                h.wait()
        self._issue_deferred(victim)
        for h in [*victim.reads.values(), *victim.writes.values(), *victim.readers]:
            self._wait(h, f"finishing I/O of block {victim.block} before its cache slot is reused")
        self.counters["evict_wait_s"] += time.monotonic() - t0
        if victim.block is not None:
            del self._by_block[victim.block]
        victim.block, victim.valid = block, set()
        victim.reads, victim.writes, victim.readers = {}, {}, []
        self._by_block[block] = victim
        self.counters["misses"] += blocking
        return victim

    @staticmethod
    def _quiet(slot: _Slot) -> bool:
        return not slot.deferred and all(
            h.done() for h in [*slot.reads.values(), *slot.writes.values(), *slot.readers])

    def _write(self, slot: _Slot, state: str, deps) -> None:
        """Submit the write-back of ``state`` of the slot's block, after the engine handles ``deps``."""
        block = slot.block
        slot.valid.discard(state)  # until the write is issued, the file is behind the buffer
        handle = self._submit(self._files[state].write, self._record[state][block], state,
                              slot.buffers[state], queue=self._write_q, after=deps,
                              what=f"writing {state} of block {block}")
        slot.valid.add(state)
        slot.writes[state] = handle
        self._written[state].add(block)
        self._events.append(("file_write", block, handle))
        self.counters["write_bytes"] += handle.nbytes
        self.counters["writes"] += 1

    def _issue_deferred(self, slot: _Slot | None = None) -> None:
        """Submit the deferred write-backs (of ``slot``, else of every slot) whose device copies are
        done; never waits."""
        for s in self._slots if slot is None else (slot,):
            for state, (waits, deps) in list(s.deferred.items()):
                if all(h.done() for h in waits):
                    del s.deferred[state]
                    self._write(s, state, deps)

    def _stage(self, slot: _Slot, block: int, states, fresh) -> list:
        reads = []
        for state in states:
            n = self.numels[state][block]
            if state in fresh:
                slot.valid.add(state)
                slot.reads.pop(state, None)
                continue
            if state not in slot.valid:
                if block not in self._written[state]:
                    slot.buffers[state][:n].zero_()  # never written: moments and sums start at zero
                    self.counters["zero_fills"] += 1
                else:
                    handle = self._submit(self._files[state].read, self._record[state][block], state,
                                          slot.buffers[state], queue=self._read_q,
                                          what=f"reading {state} of block {block}")
                    slot.reads[state] = handle
                    self._events.append(("file_read", block, handle))
                    self.counters["read_bytes"] += handle.nbytes
                    self.counters["reads"] += 1
                slot.valid.add(state)
            if state in slot.reads:
                reads.append((state, slot.reads[state]))
        return reads

    def _submit(self, request, *args, what: str, **kwargs) -> CopyHandle:
        try:
            return request(*args, **kwargs)
        except RuntimeError as e:  # the file or engine refused the request (closed, bad size)
            err = DiskTierError(f"NVMe tier {self.directory}: {what} could not start: {e}")
            self._failed = self._failed or err
            raise err from e

    def _wait(self, handle: CopyHandle, what: str) -> None:
        try:
            handle.wait()
        except CopyError as e:
            err = DiskTierError(f"NVMe tier {self.directory}: {what} failed: {e}")
            self._failed = self._failed or err
            raise err from e

    def _raise_failed(self) -> None:
        if self._failed is None:
            with self._cond:
                failed = [(h, s, slot.block) for slot in self._slots for s, h in slot.writes.items() if h.failed]
            if failed:
                handle, state, block = failed[0]
                self._wait(handle, f"writing {state} of block {block}")
        if self._failed is not None:
            raise DiskTierError(f"{self._failed} (the NVMe tier stopped at the first failure; "
                                "restart from the last checkpoint)")

    # ---- whole-tier operations

    def synchronize(self) -> None:
        """Wait for every read and write in flight; raise the first failure."""
        with self._cond:
            device = [h for s in self._slots for waits, _ in s.deferred.values() for h in waits]
        for h in device:
            h.wait()
        with self._cond:
            self._issue_deferred()
            pending = [(h, f"I/O of block {s.block}") for s in self._slots
                       for h in [*s.reads.values(), *s.writes.values(), *s.readers]]
        for h, what in pending:
            self._wait(h, what)
        self._raise_failed()

    def take_events(self) -> list[tuple[str, int, CopyHandle]]:
        """File reads and writes issued since the last call (kind, block, handle), for the trace."""
        with self._cond:
            out, self._events = self._events, []
        return out

    def stats(self) -> dict:
        """Counters: bytes and requests read/written, cache hits/misses, zero fills, and the
        seconds spent waiting for an evicted slot's I/O."""
        return dict(self.counters, directory=str(self.directory), file_bytes=self.file_bytes(),
                    cache_bytes=self.arena.capacity_bytes, cache_blocks=len(self._slots))

    def file_bytes(self) -> int:
        """Bytes of the tier's files on disk."""
        return sum(f.file_bytes() for f in self._files.values())

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def close(self) -> None:
        """Finish the I/O in flight (errors are logged: the tier is scratch) and close the files."""
        try:
            self.synchronize()
        except DiskTierError as e:
            log.warning("closing the NVMe tier after a failure: %s", e)
        self._close_files()
