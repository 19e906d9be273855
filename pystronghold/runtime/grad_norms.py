"""The streamed blocks' per-parameter gradient norms for global-norm clipping, taken where the
gradients are.

``torch.nn.utils.clip_grad_norm_`` takes one fp32 L2 norm per parameter, then the norm of those
norms. The engine does the same (``pystronghold.parallel.data.global_grad_norm`` combines them), and
each per-parameter norm is computed as PyTorch computes it on the device that holds the gradient
(``pystronghold.optim.functional.param_grad_norms``):

- on the host (the CPU backend, and the host copies of streamed blocks):
  ``torch.linalg.vector_norm`` of the fp32 gradient x grad_scale, the parameters shared among
  threads by the operator ``torch.ops.pystronghold.param_grad_norms`` (csrc/grad_norms.cpp): each
  parameter's reduction is torch's own on one thread, so every norm is the single-threaded one;
- on a CUDA device: ``torch._foreach_norm``, what ``clip_grad_norm_`` runs on CUDA. A streamed
  block's norms are taken from its slot right before the gradient's copy-out, queued on the
  compute stream: the gradient is there anyway, and no host pass over it is needed.

``BlockGradNorms`` collects the streamed blocks' norms of one step from either place.
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
