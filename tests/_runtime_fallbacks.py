"""TEMPORARY test scaffolding until branches `copy` and `adam` are merged: torch-only stand-ins
for pystronghold.io (CopyEngine, HostArena) and pystronghold.optim.functional (adam_step_,
grad_sq_norm), installed only when the real modules are missing. Never used by shipped code.
Delete this file once `git merge main` brings the real ones."""

from __future__ import annotations

import importlib
import math
import queue
import sys
import threading
import time
import types

import torch


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
        return False
    except ImportError:
        return True


class _Handle:
    def __init__(self, dst, src, after):
        self.nbytes = dst.numel() * dst.element_size()
        self._dst, self._src, self._after = dst, src, list(after)
        self._event = threading.Event()
        self.start_s = self.end_s = 0.0
        self._error = None

    def _run(self):
        try:
            for h in self._after:
                h.wait()
            self.start_s = time.monotonic()
            self._dst.copy_(self._src)
            self.end_s = time.monotonic()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
        self._dst = self._src = self._after = None
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self, timeout_s=None):
        if not self._event.wait(timeout_s):
            raise TimeoutError("copy not done")
        if self._error is not None:
            raise self._error


class CopyEngine:
    def __init__(self, threads=2, queues=4, chunk_bytes=8 << 20):
        self._queues = [queue.Queue() for _ in range(queues)]
        self._threads = [threading.Thread(target=self._worker, args=(q,), daemon=True) for q in self._queues]
        for t in self._threads:
            t.start()

    def _worker(self, q):
        while True:
            h = q.get()
            if h is None:
                return
            h._run()

    def copy(self, dst, src, queue=0, after=()):
        assert dst.nbytes == src.nbytes, (dst.shape, src.shape)
        h = _Handle(dst, src, after)
        self._queues[queue].put(h)
        return h

    def close(self):
        for q in self._queues:
            q.put(None)


class HostArena:
    def __init__(self, capacity_bytes, alignment=4096, pin="auto", lock=False):
        self.capacity_bytes = int(capacity_bytes)
        self.alignment = alignment
        self._buf = torch.empty(self.capacity_bytes + alignment, dtype=torch.uint8)
        self._base = (-self._buf.data_ptr()) % alignment
        self.used_bytes = 0

    def allocate(self, name, shape, dtype):
        nbytes = math.prod(shape) * dtype.itemsize
        start = (self.used_bytes + self.alignment - 1) // self.alignment * self.alignment
        if start + nbytes > self.capacity_bytes:
            raise MemoryError(f"HostArena: {name} needs {nbytes} at {start}, capacity {self.capacity_bytes}")
        self.used_bytes = start + nbytes
        return self._buf[self._base + start:self._base + start + nbytes].view(dtype).view(shape)


def adam_step_(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
               adamw=True, grad_scale=1.0, shadow=None):
    g = grad.float() * grad_scale
    if not torch.isfinite(g).all():
        return False
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if shadow is not None:
        shadow.copy_(param)
    return True


def grad_sq_norm(grad, grad_scale=1.0):
    return float((grad.double() * grad_scale).square().sum())


def install() -> None:
    if _missing("pystronghold.io"):
        mod = types.ModuleType("pystronghold.io")
        mod.CopyEngine, mod.HostArena = CopyEngine, HostArena
        sys.modules["pystronghold.io"] = mod
    if _missing("pystronghold.optim.functional"):
        if _missing("pystronghold.optim"):
            sys.modules["pystronghold.optim"] = types.ModuleType("pystronghold.optim")
        mod = types.ModuleType("pystronghold.optim.functional")
        mod.adam_step_, mod.grad_sq_norm = adam_step_, grad_sq_norm
        sys.modules["pystronghold.optim.functional"] = mod


install()
