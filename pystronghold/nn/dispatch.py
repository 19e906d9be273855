"""Which implementation of a fused op runs: our Triton kernel or torch's own path.

``DISPATCHER.path(op, tensor, key, ...)`` answers "torch" where Triton cannot run (CPU unless
``PYSTRONGHOLD_TRITON_ON_CPU=1``, other devices, triton missing); otherwise it obeys
``PYSTRONGHOLD_KERNELS`` ("triton", "torch" or "auto"). "auto" on CUDA times both paths
forward+backward once per process and shape class and keeps the faster (summed over ranks so all
agree); elsewhere, and for the cross-entropy, it means Triton.

NOTE: the key has no grad flag: the no-grad forward and the recompute must take the same path.
"""

from __future__ import annotations

import functools
import logging
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

ENV = "PYSTRONGHOLD_KERNELS"
OPS = ("attention", "layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add", "vocab_parallel_cross_entropy")
MODES = ("auto", "triton", "torch")
PATHS = ("triton", "torch")
TIMED_OPS = tuple(op for op in OPS if op != "vocab_parallel_cross_entropy")
"""Ops whose "auto" mode is measured (the others take Triton wherever it runs, see above)."""
WARMUP_CALLS, TIMED_CALLS = 3, 10

_log = logging.getLogger(__name__)

Timer = Callable[[str, str, Callable[[], object]], float]
"""timer(op, path, run) -> seconds per call of `run` (forward+backward of `path` on the call's inputs)."""
Agree = Callable[[dict], dict]
"""agree({path: seconds}) -> {path: seconds} combined over the ranks (identity with one process)."""


# ---- the environment variable


@functools.lru_cache(maxsize=16)
def parse_modes(value: str) -> dict[str, str]:
    """{op: mode} for every op in OPS from a PYSTRONGHOLD_KERNELS value.

    The value is a comma-separated list: a bare mode ("auto", "triton", "torch") sets every op, and
    `op:mode` sets one op whatever the order (e.g. "torch,attention:triton"). Empty means "auto".
    Raises ValueError (one line naming the variable) on an unknown op or mode, or a repeated entry.
    """
    default, per_op = None, {}
    for raw in value.split(",") if value.strip() else []:
        entry = raw.strip()
        op, sep, mode = entry.rpartition(":")
        op, mode = op.strip(), mode.strip()
        if mode not in MODES:
            raise ValueError(f"{ENV}={value!r}: mode {mode!r} in {entry!r} is not one of {', '.join(MODES)}")
        if not sep:
            if default is not None:
                raise ValueError(f"{ENV}={value!r}: more than one default mode")
            default = mode
        elif op not in OPS:
            raise ValueError(f"{ENV}={value!r}: unknown op {op!r}; expected one of {', '.join(OPS)}")
        elif op in per_op:
            raise ValueError(f"{ENV}={value!r}: op {op!r} is given twice")
        else:
            per_op[op] = mode
    return {op: per_op.get(op, default or "auto") for op in OPS}


def size_bucket(n: int) -> int:
    """The power of two at or above `n` (1 for n <= 1): sizes in one bucket share a timing."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# ---- timing and agreement


def cuda_timer(op: str, path: str, run: Callable[[], object]) -> float:
    """Median seconds of `run()` over TIMED_CALLS calls after WARMUP_CALLS, with CUDA events.

    A fixed number of calls (not a time budget as `triton.testing.do_bench`), so collectives inside
    `run` are issued equally often on every rank.
    """
    for _ in range(WARMUP_CALLS):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(TIMED_CALLS)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def agree_across_ranks(times: dict) -> dict:
    """Sum each path's seconds over the default process group (identity without one)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return times
    on_cuda = "nccl" in str(dist.get_backend()) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    packed = torch.tensor([times[p] for p in PATHS], dtype=torch.float64, device=device)
    dist.all_reduce(packed)
    return dict(zip(PATHS, packed.tolist()))


# ---- the dispatcher


@dataclass(frozen=True, slots=True)
class Choice:
    """The path picked for one shape class and the seconds per forward+backward that decided it
    (summed over ranks; inf for a path that refused the inputs)."""

    path: str
    triton_s: float
    torch_s: float


class Dispatcher:
    """Chooses, caches and reports the path of each op per shape class (see the module docstring).

    `timer` and `agree` are injectable (tests pass fakes that say which path is faster);
    `measured_devices` are the device types on which "auto" measures (CUDA by default).
    """

    def __init__(self, timer: Timer = cuda_timer, agree: Agree = agree_across_ranks,
                 measured_devices: tuple[str, ...] = ("cuda",)) -> None:
        self.timer, self.agree, self.measured_devices = timer, agree, measured_devices
        self._choices: dict[tuple, Choice] = {}

    def choices(self) -> dict[tuple, Choice]:
        """A copy of the measured choices, keyed (op, device, *shape class)."""
        return dict(self._choices)

    def clear(self) -> None:
        """Forget every measured choice (the next call of each shape class measures again)."""
        self._choices.clear()

    def path(self, op: str, mode: str, device: torch.device, key: tuple,
             candidates: dict[str, Callable], args: tuple, kwargs: dict) -> str:
        """"triton" or "torch" for `op` in `mode` on `device` (Triton assumed runnable there).

        `candidates[path](*args, **kwargs)` runs one path; only called to measure.
        """
        if mode != "auto":
            return mode
        if device.type not in self.measured_devices or op not in TIMED_OPS:
            return "triton"
        full_key = (op, str(device), *key)
        choice = self._choices.get(full_key)
        if choice is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return "torch"  # cannot time inside a CUDA graph capture; nothing cached
            choice = self._measure(op, full_key, candidates, args, kwargs)
            self._choices[full_key] = choice
        return choice.path

    def _measure(self, op, full_key, candidates, args, kwargs) -> Choice:
        times = {}
        for path in PATHS:
            run = _forward_backward(candidates[path], args, kwargs)
            try:
                run()  # first call outside the timing: imports, compilation, autotuning
            except ValueError as err:  # e.g. a head dim the kernel does not take
                if path == "torch":
                    raise
                _log.info("%s: the Triton kernel refuses %s (%s); using torch", op, full_key[1:], err)
                times[path] = float("inf")
                continue
            times[path] = float(self.timer(op, path, run))
        times = self.agree(times)
        path = "triton" if times["triton"] < times["torch"] else "torch"  # a tie keeps torch's path
        _log.info("%s %s: triton %.3g ms, torch %.3g ms (forward+backward) -> %s", op, full_key[1:],
                  times["triton"] * 1e3, times["torch"] * 1e3, path)
        return Choice(path, times["triton"], times["torch"])


def _forward_backward(fn: Callable, args: tuple, kwargs: dict) -> Callable[[], object]:
    """A closure running `fn` forward and backward on detached copies (views) of the floating inputs,
    so the caller's autograd graph and `.grad`s are untouched; forward only in inference mode."""
    inference = torch.is_inference_mode_enabled() or any(
        isinstance(a, torch.Tensor) and a.is_inference() for a in args)
    leaves = [a.detach().requires_grad_(not inference) if _floating(a) else a for a in args]
    grad_inputs = [a for a in leaves if _floating(a)]

    def run():
        if inference:
            return fn(*leaves, **kwargs)
        with torch.enable_grad():
            out = fn(*leaves, **kwargs)
            return torch.autograd.grad(out, grad_inputs, torch.ones_like(out), allow_unused=True)

    return run


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


DISPATCHER = Dispatcher()
"""The process-wide dispatcher `pystronghold.nn.functional` uses (tests may replace it)."""
