"""Saved block inputs staged to host memory and brought back for their block's backward.

A recomputed block keeps only its inputs for backward (activation checkpointing); at long
sequence lengths those inputs, T x H per block, are what holds the device. ``SavedInputs`` keeps
them on the device while a byte budget allows and stages the rest: each storage is copied to host
memory (pinned on CUDA) by the backend's copy engine after the compute issued so far, and its
device memory is given up once that copy is done (polled, never waited for in forward). Before
the block's backward the bytes are copied back into device memory (NaN-filled first in strict
mode, so a missing wait shows), and compute waits for that copy. Its users: the relay schedule
(``relay.py``: every micro-batch's inputs of a pass) and the default schedule's input offload
(``blocks/block_fn.py`` with ``RuntimeConfig.offload_block_inputs``). docs/DESIGN.md "Input offload".

Only storages this forward made are staged (an op's output, a view of one, or a tensor the caller
names as its own: the relay's cut leaves). A user's input, a parameter or slot view, and a tensor
made without a graph (a mask, rotary cos/sin shared by every block) stay where they are, counted
once against the budget.

Two ways to give the device memory up:
- *release* (input offload): the graph does not keep a staged tensor (the caller saves None in its
  place); the stage drops its own reference once the copy is done, so the memory returns when the
  model drops its reference, as with ``torch.autograd.graph.save_on_cpu``. A model that reads a
  block's input after the block stays right. Backward gets new tensors over the restored bytes,
  with the original offsets, shapes and strides.
- *shrink* (relay): the relay's cuts keep the block outputs themselves, the next blocks' inputs,
  so the storage is shrunk in place (``resize_(0)``) and grown back for the copy home.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

__all__ = ["SavedInputs"]


def _bytes_of(storage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Staged:
    """One storage of saved block inputs staged to host memory."""

    __slots__ = ("storage", "nbytes", "host", "handle", "freed", "back", "source", "version", "to_disk",
                 "offset", "written", "reading")

    def __init__(self, storage, nbytes: int, host: torch.Tensor, handle, source: torch.Tensor | None,
                 to_disk: bool = False) -> None:
        self.storage, self.nbytes, self.host, self.handle = storage, nbytes, host, handle
        self.freed = False  # the device bytes given up (the copy-out is done)
        self.back = None  # the copy bringing it back, once issued
        # the NVMe tier (input_spill.py): written once the copy-out is done, then the host buffer dropped
        self.to_disk, self.offset, self.written, self.reading = to_disk, None, None, None
        # release: the tensor whose in-place change before the copy-out is done would tear the copy
        self.source, self.version = source, None if source is None else source._version


class _Call:
    """The staged storages of one block call, and (release) how to rebuild its saved tensors."""

    __slots__ = ("block", "stages", "views")

    def __init__(self, block: int) -> None:
        self.block = block
        self.stages: list[_Staged] = []
        # release: (position among the saved tensors, stage index, storage offset, size, stride, dtype)
        self.views: list[tuple] = []


class SavedInputs:
    """The saved inputs of a pass's block calls: kept on the device up to ``budget_bytes`` (None:
    all of them), the rest staged through host memory by ``backend``'s copies.

    ``strict``: a restored storage is NaN-filled before its copy back. ``shrink``: staged storages
    are shrunk in place and grown back (the relay); else released (see the module docstring).
    ``spill``: an ``input_spill.InputSpill``: staged bytes beyond its host budget go on to disk.
    ``track(kind, block, handle)``: told of each copy ("act_d2h" out, "act_h2d" back; the
    executor's trace and ``synchronize`` follow them); ``timed``: copies carry device marks.
    """

    def __init__(self, backend, budget_bytes: int | None = None, *, strict: bool = False, shrink: bool = False,
                 track: Callable[[str, int, object], None] | None = None, timed: bool = False,
                 spill=None) -> None:
        self._backend, self._budget, self._strict, self._shrink = backend, budget_bytes, strict, shrink
        self._track, self._timed, self._spill = track, timed, spill
        if spill is not None:
            spill.new_pass()
        self.host_bytes = 0
        """Bytes of staged inputs held in host memory now."""
        self.disk_bytes = 0
        """Bytes of staged inputs written on to disk (the NVMe tier) in this pass."""
        self.device_bytes = 0
        """Bytes of saved block inputs kept on the device."""
        self.staged_bytes = 0
        """Bytes of saved block inputs staged to host memory."""
        self._calls: dict[Hashable, _Call] = {}  # in staging order
        self._seen: dict[int, object] = {}  # data_ptr -> the storage counted there
        self._keys = 0
        self.skip_restore_wait = False
        """Test hook: compute does not wait for the copies back (strict mode must then catch it)."""

    # ---- forward

    def next_key(self) -> int:
        """A key no block call of this object has had (for a caller without keys of its own)."""
        self._keys += 1
        return self._keys

    def keep_or_stage(self, key: Hashable, block: int, saved: Sequence[torch.Tensor],
                      owned: frozenset[int] | set[int] = frozenset()) -> list[bool]:
        """The tensors block call ``key`` (of block ``block``) saves for its recompute: kept on the
        device while the budget allows, else staged. ``owned``: ids of tensors the caller made
        although they have no ``grad_fn``. Returns, per tensor, whether it was staged; release
        mode: the caller must not keep a staged one (``restored`` gives it back)."""
        device = self._backend.device
        staged = [False] * len(saved)
        call = _Call(block)
        local: dict[int, int] = {}  # release: data_ptr -> index of its stage in this call
        for i, t in enumerate(saved):
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if not self._shrink and ptr in local:  # another view of a storage this call stages
                self._add_view(call, i, local[ptr], t)
                staged[i] = True
                continue
            if nbytes == 0 or self._still_there(ptr):
                continue
            root = t._base if t._base is not None else t  # a view's storage belongs to its base
            own = (id(t) in owned or root.grad_fn is not None) and type(t) is torch.Tensor \
                and t.layout == torch.strided and t.device == device
            if not own or self._budget is None or self.device_bytes + nbytes <= self._budget:
                self.device_bytes += nbytes
                if self._shrink or not own:
                    # NOTE: release mode does not hold a storage of its own: it would outlive its backward
                    self._seen[ptr] = storage
                continue
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            handle = self._backend.d2h(host, _bytes_of(storage, device), after=[self._backend.compute_marker()],
                                       timed=self._timed)
            to_disk = self._spill is not None and self.host_bytes + nbytes > self._spill.host_budget_bytes
            self.host_bytes += nbytes
            if self._shrink:
                self._seen[ptr] = storage
                call.stages.append(_Staged(storage, nbytes, host, handle, None, to_disk))
            else:
                local[ptr] = len(call.stages)
                call.stages.append(_Staged(storage, nbytes, host, handle, t, to_disk))
                self._add_view(call, i, local[ptr], t)
                staged[i] = True
            self.staged_bytes += nbytes
            if self._track is not None:
                self._track("act_d2h", block, handle)
        if call.stages:
            if key in self._calls:
                raise RuntimeError(f"saved inputs: block call {key!r} staged twice")
            self._calls[key] = call
        self.free_copied(wait=False)
        return staged

    @staticmethod
    def _add_view(call: _Call, i: int, stage: int, t: torch.Tensor) -> None:
        call.views.append((i, stage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype))

    def _still_there(self, ptr: int) -> bool:
        """Whether the storage counted at address ``ptr`` still holds it. NOTE: a shrunk storage's
        freed memory may be reused by the next allocation (its storage object lives on, 0 bytes,
        held by the saved tensors), so an address alone does not name a storage."""
        seen = self._seen.get(ptr)
        return seen is not None and seen.nbytes() > 0 and seen.data_ptr() == ptr

    def free_copied(self, wait: bool) -> None:
        """Give up the device memory of staged storages whose copy-out finished (all: ``wait``),
        and the host memory of those whose write to disk finished."""
        for call in self._calls.values():
            for st in call.stages:
                if not st.freed and (wait or st.handle.done()):
                    self._free(st, call.block)
                if st.written is not None and st.host is not None and st.back is None and st.written.done():
                    st.written.result()  # an I/O error surfaces here
                    st.host = None
                    self.host_bytes -= st.nbytes

    def _free(self, st: _Staged, block: int) -> None:
        st.handle.wait()
        if self._shrink:
            st.storage.resize_(0)
        else:
            if st.source._version != st.version:
                raise RuntimeError(
                    f"block {block}'s input was changed in place while it was being copied to host memory "
                    "(its backward needs the value of its forward); do not modify a block's input after "
                    "the block, or train without offload_block_inputs")
            st.storage = st.source = None  # the model's own reference, if any, keeps the memory
        st.freed = True
        if st.to_disk:  # its bytes are on the host now: on to the file
            st.offset, st.written = self._spill.write(st.host)
            self.disk_bytes += st.nbytes

    # ---- backward

    def pending(self) -> list[Hashable]:
        """Keys of the block calls whose staged inputs have not been brought back yet, in staging order."""
        return list(self._calls)

    def previous(self, key: Hashable) -> Hashable | None:
        """The call staged last before ``key`` and not brought back yet: the next one backward (for
        a ``key`` that staged nothing, the last call not brought back)."""
        before = None
        for k in self._calls:
            if k == key:
                return before
            before = k
        return before

    READ_AHEAD = 2
    """Block calls beyond the one restored whose inputs on disk start their read back."""

    def _read(self, call: _Call) -> None:
        """Start reading back the stages of ``call`` whose host buffer went (written to disk)."""
        for st in call.stages:
            if not st.freed:
                self._free(st, call.block)
            if st.host is None and st.reading is None:
                st.reading = self._spill.read(st.offset, st.nbytes, pin=self._backend.device.type == "cuda")

    def issue_restore(self, key: Hashable) -> None:
        """Start bringing back the staged inputs of block call ``key`` (nothing if none, or issued);
        inputs on disk: theirs read first, and the next ``READ_AHEAD`` calls' reads started."""
        call = self._calls.get(key)
        if call is None:
            return
        device = self._backend.device
        if self._spill is not None:
            ahead = key
            for _ in range(self.READ_AHEAD):
                ahead = self.previous(ahead)
                if ahead is None:
                    break
                self._read(self._calls[ahead])
            self._read(call)
        for st in call.stages:
            if st.back is not None:
                continue
            if not st.freed:  # its copy-out is still running: the bytes come back through the host all the same
                self._free(st, call.block)
            if st.reading is not None:  # from disk
                st.host = st.reading.result()
                self.host_bytes += st.nbytes
            if self._shrink:
                st.storage.resize_(st.nbytes)
                dst = _bytes_of(st.storage, device)
            else:
                dst = torch.empty(st.nbytes, dtype=torch.uint8, device=device)
                st.storage = dst.untyped_storage()
            if self._strict:
                dst.fill_(255)  # NaN in every float type
            # NOTE: after the compute issued so far: on CUDA the (re-)allocated memory may still be
            # read by kernels queued on the compute stream
            st.back = self._backend.h2d(dst, st.host, after=[self._backend.compute_marker()], timed=self._timed)
            if self._track is not None:
                self._track("act_h2d", call.block, st.back)

    def restored(self, key: Hashable) -> dict[int, torch.Tensor]:
        """Compute waits for the staged inputs of block call ``key`` (their copy back issued now if
        it was not); release mode: the staged tensors by their position among the saved ones."""
        self.issue_restore(key)
        call = self._calls.pop(key, None)
        if call is None:
            return {}
        for st in call.stages:
            if not self.skip_restore_wait:
                self._backend.compute_wait(st.back)
            self.host_bytes -= st.nbytes  # the host buffer goes with the call (the copy holds it while it runs)
        device = self._backend.device
        return {i: torch.empty(0, dtype=dtype, device=device).set_(call.stages[s].storage, offset, size, stride)
                for i, s, offset, size, stride, dtype in call.views}

    def discard(self) -> None:
        """An abandoned pass: every copy and file I/O in flight waited for, every stage dropped."""
        for call in self._calls.values():
            for st in call.stages:
                st.handle.wait()
                if st.back is not None:
                    st.back.wait()
                for io in (st.written, st.reading):
                    if io is not None:
                        io.exception()  # waits; the pass is abandoned already
        self._calls.clear()
        self._seen.clear()
