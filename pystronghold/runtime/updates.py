"""The host side of the optimizer: per-block gradient norms and fused Adam updates on a worker thread.

Every job first waits for the block's gradient copy-out, then works on the host store only, so it
overlaps the device's compute of other blocks. ``adam_step_`` and torch's reductions release the GIL.

NOTE: gradient norms are per parameter, fp32, ``torch.linalg.vector_norm`` over each parameter's
view of the flat buffer, then combined exactly as ``torch.nn.utils.clip_grad_norm_`` does; so
clipping is bit-for-bit the PyTorch one (a float64 flat norm would differ in the last bits, and
Adam turns last-bit differences of near-zero gradients into visible ones through eps).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pystronghold.optim.functional import adam_step_

__all__ = ["HostUpdates"]


class HostUpdates:
    """Submits norm and update jobs for blocks; remembers one pending future per block."""

    def __init__(self, store, tracer, *, bitwise_torch: bool = False) -> None:
        self.store = store
        self.tracer = tracer
        self.bitwise_torch = bitwise_torch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pystronghold-adam")
        self.updates: dict[int, Future] = {}  # block -> its latest update job
        self.norms: dict[int, Future] = {}  # block -> per-parameter gradient norms

    def submit_norm(self, block: int, grad_handle, grad_scale: float) -> None:
        """Per-parameter L2 norms (fp32) of the block's gradient x ``grad_scale``, after its copy-out."""
        views = self.store.layouts[block].views(self.store.tiers["grad"][block])

        def job() -> torch.Tensor:
            grad_handle.wait()
            with self.tracer.span("norm", block):
                return torch.stack([torch.linalg.vector_norm(v.float() * grad_scale if grad_scale != 1.0
                                                             else v.float()) for v in views])

        self.norms[block] = self._pool.submit(job)

    def submit_update(self, block: int, grad_handle, *, step: int, hyper: dict, grad_scale: float) -> None:
        """Run AdamW on the block's master buffer (and refresh its shadow) after its copy-out."""
        t = self.store.tiers
        shadow = t["shadow"][block] if self.store.has_shadow else None
        beta1, beta2 = hyper["betas"]

        def job() -> None:
            if grad_handle is not None:
                grad_handle.wait()
            with self.tracer.span("optimizer", block, nbytes=t["master"][block].nbytes):
                ok = adam_step_(t["master"][block], t["grad"][block], t["exp_avg"][block],
                                t["exp_avg_sq"][block], step=step, lr=hyper["lr"], beta1=beta1,
                                beta2=beta2, eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                                adamw=True, grad_scale=grad_scale, shadow=shadow,
                                bitwise_torch=self.bitwise_torch)
            if not ok:
                raise FloatingPointError(
                    f"block {block}: its gradient has inf/NaN values; the update was not applied. "
                    "Use precision='fp16' loss scaling or clip_grad_norm to skip such steps.")

        self.updates[block] = self._pool.submit(job)

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
