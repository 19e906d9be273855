"""The context ``train --model hf:DIR`` takes without --seq: the model's positions, capped by what
fits this machine (``planner.sequence.default_context``), said in one line at start-up."""

from __future__ import annotations

from pystronghold.models.hf import HF_DEFAULT_SEQ, NO_POSITION_LIMIT, HFModelConfig
from pystronghold.settings.finetune import FinetuneOptions

__all__ = ["hf_default_seq", "this_machine"]


def this_machine():
    """The planner's ``Hardware`` of this machine: its CUDA device 0 and RAM; on the CPU, half the
    RAM as the "device" (activations, window) and half as the host store, since both share it."""
    import torch

    from pystronghold.planner.hardware import GPU, PCIE_GEN4, TFLOPS, Hardware, local_gpu, local_host_memory_bytes

    host = local_host_memory_bytes()
    if torch.cuda.is_available():
        return Hardware(gpu=local_gpu(tflops=100.0), host_memory_bytes=host)
    cpu = GPU(name="cpu", memory_bytes=host // 2, fp32_flops=TFLOPS, bf16_flops=TFLOPS, fp16_flops=TFLOPS,
              h2d_bytes_per_s=PCIE_GEN4, d2h_bytes_per_s=PCIE_GEN4)
    return Hardware(gpu=cpu, host_memory_bytes=host - host // 2)


def hf_default_seq(cfg: HFModelConfig, shape, batch: int, precision: str,
                   finetune: FinetuneOptions) -> tuple[int, str]:
    """(tokens, why in words) of the default context of the Hugging Face model ``cfg``, whose planner
    shape is ``shape`` (``planner.hf_shape.HFShape``; None for one the planner cannot read), trained
    at ``batch`` samples in ``precision`` with ``finetune`` on this machine."""
    from pystronghold.planner.cost import Workload
    from pystronghold.planner.hardware import format_bytes
    from pystronghold.planner.sequence import default_context

    positions = None if cfg.seq_len == NO_POSITION_LIMIT else cfg.seq_len
    if shape is None:
        # NOTE: a model that cannot be trained at all is refused, in one line, when it is loaded
        return positions or HF_DEFAULT_SEQ, "the model's positions (its shape is not one the planner reads)"
    hw = this_machine()
    seq, why = default_context(shape, Workload(batch=batch, precision=precision, finetune=finetune), hw, positions)
    if hw.gpu.name == "cpu":
        where = f"this CPU, {format_bytes(hw.gpu.memory_bytes + hw.host_memory_bytes)} of RAM, half of it as the device"
    else:
        where = f"{hw.gpu.name} with {format_bytes(hw.host_memory_bytes)} of host memory"
    return seq, f"{why} {where}"
