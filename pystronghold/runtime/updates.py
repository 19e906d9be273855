"""The host side of the optimizer: per-block gradient norms and fused Adam updates on a worker thread.

Each job waits for the block's gradient copy-out, then works on the host store only, overlapping
device compute; ``adam_step_`` and torch's reductions release the GIL. NOTE: norms are per
parameter in fp32, combined as ``clip_grad_norm_`` does, so clipping is bit-for-bit PyTorch's.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pystronghold.optim.functional import adam_step_, adam_step_multi_, grad_sq_norm, param_grad_norms
from pystronghold.optim.hyper import AdamWHyper
from pystronghold.runtime.optimizer.divergence import DivergenceError
from pystronghold.runtime.memory.layout import state_dtype, stored_states

__all__ = ["HostUpdates", "undo_bytes"]


class HostUpdates:
    """Submits norm and update jobs for blocks; remembers one pending future per block.

    Jobs work on leases of the store (``HostStore.acquire``): host buffers directly, disk states
    staged in the file tier's cache. Before waiting for its own reads, a job starts the reads of
    the next queued blocks (``prefetch_depth`` of them), so disk reads overlap the Adam pass.
    """

    update_states = ("master", "exp_avg", "exp_avg_sq")
    """States an update reads and writes back (besides the gradient it reads and the shadow it writes)."""

    def __init__(self, store, tracer, *, bitwise_torch: bool = False, prefetch_depth: int = 2,
                 param_groups: list[list[int]] | None = None) -> None:
        """``param_groups``: per block, the optimizer param group of each trainable parameter
        (default: all 0). A wholly frozen block gets no job."""
        self.store = store
        self._group_ranges = [_group_ranges(layout, None if param_groups is None else param_groups[b])
                              for b, layout in enumerate(store.layouts)]
        self.tracer = tracer
        self.bitwise_torch = bitwise_torch
        self.prefetch_depth = prefetch_depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pystronghold-adam")
        self.updates: dict[int, Future] = {}  # block -> its latest update job
        self.norms: dict[int, Future] = {}  # block -> per-parameter gradient norms
        self._queued: deque[int] = deque()  # blocks of update jobs submitted, not started
        self._saved: dict[int, dict[str, torch.Tensor]] = {}  # block -> pre-step states (speculation), reused
        self.speculated: dict[int, list[AdamWHyper] | None] = {}
        """Blocks updated speculatively this step (``submit_update(speculate=True)``) -> the hyper
        their update applied, or None when it was not applied (inf/NaN values, nothing written)."""
        self.unsettled: set[int] = set()
        """Blocks whose speculative update was submitted and neither kept (``keep``) nor redone/undone."""

    def submit_norm(self, block: int, grad_handle, grad_scale: float) -> None:
        """Per-parameter L2 norms (fp32) of the block's gradient x ``grad_scale``, after its copy-out."""
        layout = self.store.layouts[block]

        def job() -> torch.Tensor:
            grad_handle.wait()
            lease = self.store.acquire(block, ["grad"])
            try:
                lease.wait()
                with self.tracer.span("norm", block):
                    return param_grad_norms(layout.train_views(lease.tensors["grad"]), grad_scale)
            finally:
                self.store.release(lease)

        self.norms[block] = self._pool.submit(job)

    def submit_update(self, block: int, grad_handle, *, hyper: list[AdamWHyper] | None, lease=None,
                      step: int | None = None, speculate: bool = False, redo: bool = False) -> None:
        """Run AdamW on the block's master buffer (and refresh its shadow) after its copy-out.

        hyper: each param group's values at this step, step count and gradient scale included
        (``WindowOptimizer.hyper``); handed unchanged to the fused Adam.
        lease: the gradient's lease from the copy-out when the gradient goes straight to this
        update (backward overlap); it is released, and the cached gradient dropped, afterwards.
        step: the engine's step number, for the ``DivergenceError`` of a gradient with inf/NaN
        values (default: the block's AdamW step).
        speculate: first copy the pre-step states (master, moments, shadow) aside, and record in
        ``speculated`` the hyper it applied (None: not applied) instead of raising on inf/NaN values
        (the step decides once the global norm is known).
        redo: first restore the states saved by this step's speculative update, if it applied;
        ``hyper`` None then only restores (a skipped step).
        """
        store = self.store
        ranges = self._group_ranges[block]
        n = store.layouts[block].train_numel  # the master in fp32 also holds the frozen parameters after it
        outputs = [*self.update_states, "shadow"] if store.has_shadow else list(self.update_states)
        # NOTE: a shadow that also holds frozen parameters is read first (its frozen part is kept)
        shadow_kept = store.has_shadow and store.layouts[block].frozen > 0
        if speculate:
            self.unsettled.add(block)
        if redo:
            self.unsettled.discard(block)
        restore = redo and self.speculated.pop(block, None) is not None
        if hyper is None and not restore:
            return  # an undo of a speculative update that did not apply
        # NOTE: the shadow is read (not fresh) when its pre-step values are saved or restored
        fresh = ["shadow"] if store.has_shadow and not shadow_kept and not speculate and not restore else ()
        modify = [*self.update_states, *(["shadow"] if store.has_shadow and fresh == () else [])]
        self._queued.append(block)

        def job() -> None:
            if self._queued and self._queued[0] == block:
                self._queued.popleft()
            if grad_handle is not None:
                grad_handle.wait()
            try:
                own = store.acquire(block, [*outputs, "grad"], fresh=fresh, modify=modify)
            except BaseException:
                if lease is not None:
                    store.release(lease)
                raise
            dirty = ()
            try:
                for nxt in list(self._queued)[:self.prefetch_depth]:
                    store.prefetch(nxt, [*self.update_states, "grad"])
                own.wait()
                t = {state: flat[:n] for state, flat in own.tensors.items()}
                if restore:
                    for state, saved in self._saved[block].items():
                        t[state].copy_(saved)
                    if hyper is None:
                        dirty = outputs
                        return
                if speculate:
                    saved = self._saved.setdefault(block, {s: torch.empty_like(t[s]) for s in outputs})
                    for state in outputs:
                        saved[state].copy_(t[state])
                with self.tracer.span("optimizer", block, nbytes=t["master"].nbytes):
                    ok = self._adam(t, ranges, hyper)
                if speculate:
                    self.speculated[block] = hyper if ok else None
                    if not ok:
                        return
                if not ok:
                    raise DivergenceError(hyper[0].step if step is None else step,
                                          f"the gradient of block {block} has inf/NaN values; its update "
                                          "was not applied")
                dirty = outputs
            finally:
                store.release(own, dirty=dirty, drop=["grad"] if lease is not None and not speculate else ())
                if lease is not None:  # a speculated block's gradient is kept for a redo
                    store.release(lease, dirty=["grad"] if speculate else ())

        self.updates[block] = self._pool.submit(job)

    def _adam(self, t: dict, ranges: dict[int, list[tuple[int, int]]] | None, hyper: list[AdamWHyper]) -> bool:
        """AdamW over a block's flat buffers ``t``: one call for a one-group block, else one per
        group over its element ranges (checked finite first, so nothing is written on overflow)."""
        if ranges is None:
            return adam_step_(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], hyper[0],
                              shadow=t.get("shadow"), bitwise_torch=self.bitwise_torch)
        # NOTE: every group's hyper has the step's one grad_scale
        if len(ranges) > 1 and not math.isfinite(grad_sq_norm(t["grad"], hyper[0].grad_scale)):
            return False
        for group, spans in ranges.items():

            def cut(name: str):
                return [t[name][a:b] for a, b in spans]

            if not adam_step_multi_(cut("master"), cut("grad"), cut("exp_avg"), cut("exp_avg_sq"), hyper[group],
                                    shadows=cut("shadow") if "shadow" in t else None,
                                    check_finite=len(ranges) == 1, bitwise_torch=self.bitwise_torch):
                return False
        return True

    def keep(self, block: int) -> None:
        """The block's speculative update stands (its hyper was the true one): forget its undo."""
        self.speculated.pop(block, None)
        self.unsettled.discard(block)

    def held_undo_bytes(self) -> int:
        """Host bytes held now for undoing speculative updates (the saved pre-step states; at most
        ``undo_bytes`` of the streamed blocks)."""
        return sum(t.nbytes for saved in self._saved.values() for t in saved.values())

    def pending(self, block: int) -> Future | None:
        """The block's update job if it has not finished yet, else None (re-raising its error)."""
        fut = self.updates.get(block)
        if fut is None:
            return None
        if fut.done():
            del self.updates[block]
            fut.result()
            return None
        return fut

    def block_norms(self) -> dict[int, torch.Tensor]:
        """Each block's per-parameter gradient norms (waits for the jobs)."""
        out = {block: f.result() for block, f in self.norms.items()}
        self.norms.clear()
        return out

    def in_flight(self) -> int:
        """Jobs not finished yet."""
        return sum(not f.done() for f in [*self.updates.values(), *self.norms.values()])

    def drain(self) -> None:
        """Wait for every job; re-raise the first error."""
        futures = list(self.updates.values()) + list(self.norms.values())
        self.updates.clear()
        for fut in futures:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def undo_bytes(train_numels: list[int], compute_dtype: torch.dtype) -> int:
    """Host bytes that speculative clipping (``clip_mode="speculative"``) keeps to undo a step: the
    pre-step master, moments and (bf16/fp16) shadow of every streamed block's trainable elements
    (``train_numels``, one per block): 12 B per element, 14 with a shadow."""
    states = [s for s in stored_states(compute_dtype) if s in (*HostUpdates.update_states, "shadow")]
    return sum(n * state_dtype(s, compute_dtype).itemsize for n in train_numels for s in states)


def _group_ranges(layout, groups: list[int] | None) -> dict[int, list[tuple[int, int]]] | None:
    """Element ranges of the flat buffer per param group (neighbours of one group merged, with the
    zero padding between them); None when the whole block is in group 0 (one call over the buffer)."""
    if groups is None or all(g == 0 for g in groups):
        return None
    ranges: dict[int, list[tuple[int, int]]] = {}
    previous = None
    for span, group in zip(layout.spans[:layout.trainable], groups):
        runs = ranges.setdefault(group, [])
        if group == previous:
            runs[-1] = (runs[-1][0], span.offset + span.numel)
        else:
            runs.append((span.offset, span.offset + span.numel))
        previous = group
    return ranges
