"""Switches shared by the Triton kernels: interpreter mode, the bf16 upcast, autotune pruning.

Triton decides between compiling a kernel and interpreting it when the `@triton.jit` decorator runs,
that is when a kernel module (`pystronghold.kernels.attention`, ...) is first imported: it reads
`TRITON_INTERPRET` at that moment (setting it after `import triton` but before the kernel modules are
imported works; setting it after they are imported does nothing for them). Hence:

- `PYSTRONGHOLD_TRITON_ON_CPU=1` makes `pystronghold.nn.functional` run the Triton kernels on CPU
  tensors (read at every call). If it is set and `TRITON_INTERPRET` is unset when this module is first
  imported on a machine without CUDA, `TRITON_INTERPRET=1` is set for the kernels decorated after.
- `check_runnable(device, kernel)` raises a clear error when kernels decorated for a GPU are asked to run
  on CPU tensors (the interpreter was switched on too late).

The one interpreter-only difference in the kernels is the `UPCAST` constexpr (`upcast_for_dot`): the interpreter computes bf16
arithmetic wrongly (../shared/TRITON_CPU.md), so under it the kernels convert bf16 operands to fp32
before `tl.dot`; on a GPU bf16 goes to the tensor cores unchanged. Every other computation already
loads into fp32 on both paths.
"""

from __future__ import annotations

import os

import torch

FORCE_ENV = "PYSTRONGHOLD_TRITON_ON_CPU"

if (os.environ.get(FORCE_ENV) == "1" and "TRITON_INTERPRET" not in os.environ
        and not torch.cuda.is_available()):
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after the environment above)

#: True when this process interprets the kernel modules imported from now on (read at decoration).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)

#: Dtypes every kernel accepts; the math is fp32 inside.
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting(device: torch.device) -> bool:
    """True when a kernel launched on `device` tensors runs in the interpreter.

    CPU tensors can only run interpreted; CUDA tensors do when the process interprets (TRITON_INTERPRET=1).
    Decided per launch from the tensors, so a module imported before the switch cannot get it wrong.
    """
    return device.type != "cuda" or INTERPRET


def upcast_for_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """True when bf16 operands must be converted to fp32 before `tl.dot` (interpreter only)."""
    return dtype == torch.bfloat16 and interpreting(device)


def check_runnable(device: torch.device, kernel) -> None:
    """Raise RuntimeError when `kernel` cannot run on `device` (CPU needs an interpreted kernel)."""
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    fn = kernel  # an Autotuner/Heuristics wraps the jit function in `.fn`
    while hasattr(fn, "fn") and not isinstance(fn, InterpretedFunction):
        fn = fn.fn
    if not isinstance(fn, InterpretedFunction):
        raise RuntimeError(
            f"Triton kernel {getattr(fn, '__name__', fn)!r} was compiled for a GPU, so it cannot run on "
            f"{device} tensors: set TRITON_INTERPRET=1 (or {FORCE_ENV}=1) before pystronghold.kernels "
            "modules are first imported.")


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless `t` is fp32, fp16 or bf16."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; expected float32, float16 or bfloat16")


def prune_to_one(pick, tensor_arg: str):
    """`prune_configs_by` callback: on a GPU keep all configs; under the interpreter keep one.

    `pick(configs, named_args)` returns the one config to keep; the kernel argument `tensor_arg` tells
    the device. Autotuning benchmarks through the GPU driver, which the interpreter lacks; with a
    single config left the autotuner does not time.
    """

    def early_config_prune(configs, named_args, **kwargs):
        if not interpreting(named_args[tensor_arg].device):
            return configs
        return [pick(configs, named_args)]

    return early_config_prune


def grid_programs(device: torch.device) -> int:
    """How many persistent programs a row-reduction kernel launches (SM count on a GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


_ELEMENTWISE_CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps)
                        for block, warps in ((1024, 4), (2048, 8), (4096, 8), (1024, 8))]


def elementwise_autotune(tensor_arg: str):
    """`triton.autotune` for a flat elementwise kernel with a `BLOCK` constexpr and an `n_elements`
    argument: timed over 4 configurations on a GPU (per size), the first one kept under the interpreter."""
    return triton.autotune(configs=_ELEMENTWISE_CONFIGS, key=["n_elements"],
                           prune_configs_by={"early_config_prune": prune_to_one(lambda c, _: c[0], tensor_arg)})
