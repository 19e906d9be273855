"""The window: W device slots, and which block's parameters point into which slot.

A slot is one flat parameter buffer and one flat gradient buffer in the device arena, as large as
the largest block and the largest trainable part of a block (frozen parameters have no gradient).
While block b is resident, each of its ``Parameter.data`` is a view into its
slot; otherwise it is an empty placeholder tensor, so any use of an evicted block fails loudly
(a shape error) instead of silently reading stale memory.
"""

from __future__ import annotations

import torch

from pystronghold.runtime.memory.store import BlockLayout

__all__ = ["Slot", "Window"]


class Slot:
    """One device slot: flat parameter and gradient buffers plus what must finish before reuse."""

    def __init__(self, index: int, params: torch.Tensor, grads: torch.Tensor) -> None:
        self.index = index
        self.params = params  # (max numel,) compute dtype, on the device
        self.grads = grads  # (max train_numel,) compute dtype, on the device
        self.block: int | None = None
        self.busy: list = []  # handles (copy-outs, compute markers) to finish before reuse


class Window:
    """W slots over ``len(layouts)`` blocks; counts residency for the invariant tests."""

    def __init__(self, backend, layouts: list[BlockLayout], params: list[list[torch.nn.Parameter]],
                 slots: int, compute_dtype: torch.dtype) -> None:
        self.layouts = layouts
        self.params = params
        """Each block's parameters, layout order (trainable first, then frozen)."""
        cap = max((lay.numel for lay in layouts), default=0)
        grad_cap = max((lay.train_numel for lay in layouts), default=0)
        self.slots = [Slot(i, backend.device_buffer(f"slot{i}.params", cap, compute_dtype),
                           backend.device_buffer(f"slot{i}.grads", grad_cap, compute_dtype))
                      for i in range(slots)]
        for s in self.slots:
            s.params.zero_()
            s.grads.zero_()
        # NOTE: the fills run on the compute stream and a slot's first load on the copy stream: the
        # load waits for them like for a release, or (on CUDA, a busy device) the fill may land on
        # top of the loaded block and zero it
        filled = backend.compute_marker()
        if filled is not None:
            for s in self.slots:
                s.busy.append(filled)
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=backend.device)
        self.resident: dict[int, Slot] = {}  # block -> slot, from load issue to release
        # (slot, block) -> (param views, grad views): made once, reused at every bind and copy-out
        # (a slot's buffers never move; making ~10 views per block per pass was the engine's largest
        # per-block Python cost)
        self._views: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.peak_resident = 0
        for block_params in params:
            for p in block_params:
                p.data = self._placeholder
                p.grad = None

    def occupy(self, block: int, slot: int) -> Slot:
        """Mark ``slot`` as holding ``block`` (its load is being issued)."""
        s = self.slots[slot]
        if s.block is not None:
            raise RuntimeError(f"window: slot {slot} still holds block {s.block}, cannot load block {block}")
        if block in self.resident:
            raise RuntimeError(f"window: block {block} is already resident in slot {self.resident[block].index}")
        s.block = block
        self.resident[block] = s
        self.peak_resident = max(self.peak_resident, len(self.resident))
        return s

    def trainable(self, block: int) -> list[torch.nn.Parameter]:
        """``block``'s trainable parameters (the first ones of ``params[block]``)."""
        return self.params[block][:self.layouts[block].trainable]

    def bind(self, block: int) -> Slot:
        """Point ``block``'s parameters at its slot (after its load has been waited for)."""
        s = self.resident[block]
        for p, view in zip(self.params[block], self._slot_views(s, block)[0]):
            p.data = view
        return s

    def _slot_views(self, s: Slot, block: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        views = self._views.get((s.index, block))
        if views is None:
            layout = self.layouts[block]
            views = self._views[(s.index, block)] = (layout.views(s.params), layout.train_views(s.grads))
        return views

    def vacate(self, block: int) -> Slot:
        """Point ``block``'s parameters back at the placeholder and free its slot record."""
        s = self.resident.pop(block)
        for p in self.params[block]:
            p.data = self._placeholder
        s.block = None
        return s

    def unbind(self, block: int) -> None:
        """Point a block that is not resident back at the empty placeholder (after a state load)."""
        if block in self.resident:
            raise RuntimeError(f"window: block {block} is resident; vacate it instead")
        for p in self.params[block]:
            p.data = self._placeholder

    def grad_views(self, block: int) -> list[torch.Tensor]:
        """Views of the resident ``block``'s trainable parameters' gradients in its slot."""
        return list(self._slot_views(self.resident[block], block)[1])
