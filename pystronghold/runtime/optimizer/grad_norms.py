"""The streamed blocks' per-parameter gradient norms for global-norm clipping, taken where the
gradients are.

As ``torch.nn.utils.clip_grad_norm_`` does, one fp32 L2 norm per parameter, combined by
``parallel.data.global_grad_norm``. On the host, ``optim.functional.param_grad_norms`` (torch's
reduction, single-threaded per parameter); on CUDA, ``torch._foreach_norm`` on the slot right
before the copy-out. ``BlockGradNorms`` collects one step's norms from either place.
"""

from __future__ import annotations

import torch

from pystronghold.optim.functional import param_grad_norms

__all__ = ["BlockGradNorms"]


class BlockGradNorms:
    """The streamed blocks' per-parameter gradient norms of one step, by block.

    ``on_device``: take them from the slot before the copy-out (``before_copy_out``; the CUDA
    backend's default); else on the host after it, through ``updates.submit_norm`` (the worker
    thread of the host updates, overlapping the device's compute). Both paths run on any backend;
    the CPU tests run the device path too by setting ``on_device``.
    """

    def __init__(self, updates, *, on_device: bool) -> None:
        self.updates = updates
        self.on_device = on_device
        self._device: dict[int, torch.Tensor] = {}

    def before_copy_out(self, block: int, slot_grads: list[torch.Tensor], grad_scale: float) -> None:
        """Device path: queue the norms of ``block``'s gradient (views of its slot) now."""
        if self.on_device:
            self._device[block] = param_grad_norms(slot_grads, grad_scale)

    def after_copy_out(self, block: int, grad_handle, grad_scale: float) -> None:
        """Host path: the norms of ``block``'s host gradient once ``grad_handle`` (its copy-out) is done."""
        if not self.on_device:
            self.updates.submit_norm(block, grad_handle, grad_scale)

    def take(self) -> dict[int, torch.Tensor]:
        """Every block's norms of this step on the host (waiting for the host jobs and, on the device
        path, for the device: one copy per block); forgets them."""
        out = {block: norms.cpu() for block, norms in self._device.items()}
        out.update(self.updates.block_norms())
        self._device.clear()
        return out
