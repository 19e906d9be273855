"""Per-parameter gradient norms for global-norm clipping, computed where the gradients are.

``torch.nn.utils.clip_grad_norm_`` takes one fp32 L2 norm per parameter, then the norm of those
norms. The engine does the same (``pystronghold.parallel.data.global_grad_norm`` combines them), and
each per-parameter norm is computed as PyTorch computes it on the device that holds the gradient:

- on the host (the CPU backend, and the host copies of streamed blocks):
  ``torch.linalg.vector_norm`` of the fp32 gradient x grad_scale, the parameters shared among
  threads by the native ``param_grad_norms`` (csrc/grad_norms.cpp): each parameter's reduction is
  torch's own on one thread, so every norm is bit for bit the single-threaded one;
- on a CUDA device: ``torch._foreach_norm``, what ``clip_grad_norm_`` runs on CUDA. A streamed
  block's norms are taken from its slot right before the gradient's copy-out, queued on the
  compute stream: the gradient is there anyway, and no host pass over it is needed.

``BlockGradNorms`` collects the streamed blocks' norms of one step from either place.
"""

from __future__ import annotations

import torch

from pystronghold._ext import native

__all__ = ["param_grad_norms", "device_param_grad_norms", "BlockGradNorms"]


def param_grad_norms(grads: list[torch.Tensor], grad_scale: float = 1.0) -> torch.Tensor:
    """fp32 L2 norm of each gradient x ``grad_scale``, shape (len(grads),), on the gradients' device.

    CPU: ``torch.linalg.vector_norm(g.float() * grad_scale)`` for each g, bit for bit, in parallel
    over the parameters (native). Other devices: ``device_param_grad_norms``. ``grads`` must all be
    on one device; float32, bfloat16 or float16."""
    if not grads:
        return torch.zeros(0)
    device = grads[0].device
    if any(g.device != device for g in grads):
        raise ValueError(f"param_grad_norms: grads must be on one device, got {sorted({str(g.device) for g in grads})}")
    if device.type == "cpu":
        return native().param_grad_norms(list(grads), float(grad_scale))
    return device_param_grad_norms(grads, grad_scale)


def device_param_grad_norms(grads: list[torch.Tensor], grad_scale: float = 1.0) -> torch.Tensor:
    """fp32 L2 norm of each gradient x ``grad_scale`` with ``torch._foreach_norm`` (the kernel of
    ``clip_grad_norm_`` on CUDA), stacked on the gradients' device without a host sync.

    fp32 gradients at scale 1 go to one ``_foreach_norm`` call; others are scaled in fp32 one
    parameter at a time (at most one parameter's fp32 copy alive), as the host path does."""
    if not grads:
        return torch.zeros(0)
    if grad_scale == 1.0 and all(g.dtype == torch.float32 for g in grads):
        return torch.stack(torch._foreach_norm(list(grads)))
    return torch.stack([torch._foreach_norm([g.float() * grad_scale if grad_scale != 1.0 else g.float()])[0]
                        for g in grads])


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
