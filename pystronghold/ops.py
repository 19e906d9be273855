"""The native stateless kernels as torch operators: ``torch.ops.pystronghold.*`` (csrc/ops.cpp).

``adam_step`` / ``adam_step_multi`` (fused Adam/AdamW, in place), ``grad_sq_norm`` (float64),
``param_grad_norms`` (fp32 norm per grad) and ``crc32c`` (the file tier's checksum). ``native_ops()``
loads ``pystronghold._C``, registers the fake implementations once (for FakeTensor, ``torch.compile``
and ``opcheck``) and returns the operators. Typed wrappers: ``optim.functional``,
``runtime.optimizer.grad_norms.param_grad_norms`` and ``crc32c`` here.

NOTE: the fake implementations are also the Meta kernels, so they check the device themselves.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from pystronghold._ext import native

__all__ = ["native_ops", "crc32c"]

OPS = ("adam_step", "adam_step_multi", "grad_sq_norm", "param_grad_norms", "crc32c")
"""The operators of the ``pystronghold`` namespace."""


_loaded: SimpleNamespace | None = None
_loading = threading.Lock()


def native_ops() -> SimpleNamespace:
    """The ``.default`` overloads of ``torch.ops.pystronghold.*`` by name, fake implementations
    registered; raises ``pystronghold._ext.ExtensionError`` naming the fix when _C is missing."""
    global _loaded
    if _loaded is None:
        # NOTE: the first calls may come at once from the main thread and a host-update worker;
        # registering the fakes twice raises, so the first one loads under a lock (not functools.cache)
        with _loading:
            if _loaded is None:
                native()
                _register_fakes()
                _loaded = SimpleNamespace(**{name: getattr(torch.ops.pystronghold, name).default for name in OPS})
    return _loaded


def crc32c(data: torch.Tensor, force_software: bool = False) -> int:
    """CRC32C (Castagnoli) of ``data``'s bytes in memory order, as the file tier checksums records.

    ``force_software``: the slice-by-8 table path even where the CPU has SSE4.2's crc32 instruction.
    crc32c(b"123456789") is 0xE3069283.

    Raises:
        ValueError: ``data`` is not a contiguous dense CPU tensor.
    """
    return int(native_ops().crc32c(data, bool(force_software)).item())


# ---- fake (meta) implementations

def _check_cpu(fn: str, name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} must be on the CPU, got device {t.device}")


def _fake_adam_step(param, grad, exp_avg, exp_avg_sq, shadow, step, lr, beta1, beta2, eps, weight_decay,
                    adamw, grad_scale, check_finite, bitwise_torch):
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
                    ("shadow", shadow)):
        _check_cpu("adam_step", name, t)
    return torch.empty((), dtype=torch.bool)


def _fake_adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, shadows, step, lr, beta1, beta2, eps,
                          weight_decay, adamw, grad_scale, check_finite, bitwise_torch):
    for name, ts in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                     ("shadows", shadows or ())):
        for k, t in enumerate(ts):
            _check_cpu("adam_step_multi", f"{name}[{k}]", t)
    return torch.empty((), dtype=torch.bool)


def _fake_grad_sq_norm(grad, grad_scale):
    _check_cpu("grad_sq_norm", "grad", grad)
    return torch.empty((), dtype=torch.float64)


def _fake_param_grad_norms(grads, grad_scale):
    for k, t in enumerate(grads):
        _check_cpu("param_grad_norms", f"grads[{k}]", t)
    return torch.empty(len(grads), dtype=torch.float32)


def _fake_crc32c(data, force_software=False):
    _check_cpu("crc32c", "data", data)
    return torch.empty((), dtype=torch.int64)


_FAKES = {"adam_step": _fake_adam_step, "adam_step_multi": _fake_adam_step_multi,
          "grad_sq_norm": _fake_grad_sq_norm, "param_grad_norms": _fake_param_grad_norms,
          "crc32c": _fake_crc32c}


def _register_fakes() -> None:
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"pystronghold::{name}", fake)
