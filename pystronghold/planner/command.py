"""``pystronghold plan``: the request dataclass, the argparse parser generated from it, the command.

Every field of ``PlanRequest`` becomes one option (``gpu_memory`` -> ``--gpu-memory``;
``pystronghold.options``): its type comes from the annotation, its help from the docstring under
the field, choices from the field's metadata. The runtime settings the plan assumes (--window,
--resident-blocks, --precision, --checkpointing) are ``RuntimeConfig``'s fields, declared and
validated there. Sizes are in GiB (2**30 bytes) and bandwidths in GB/s (1e9 bytes/s), as people
say them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field

from pystronghold.options import ConfigError, add_options, component, from_args
from pystronghold.runtime.config import RuntimeConfig

__all__ = ["PlanRequest", "PLAN_RUNTIME_DEFAULTS", "add_plan_command", "run_plan"]

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  pystronghold plan --gpu a100-40gb --host-memory 256 --model gpt3-6.7b --batch 4
  pystronghold plan --gpu rtx4090 --host-memory 128 --nvme 2000 --layers 48 --hidden 6144 --heads 48
  pystronghold plan --gpu-memory 24 --gpu-tflops 100 --host-memory 64 --model gpt3-2.7b --window 4 --json
exit status: 0 the model fits, 1 it does not (the report says why), 2 bad arguments."""


PLAN_RUNTIME_DEFAULTS = {"window": "auto", "resident_blocks": "auto", "precision": "bf16"}
"""Where ``pystronghold plan``'s runtime defaults differ from ``RuntimeConfig``'s: it picks K and W
and plans in bf16 unless told otherwise."""


@dataclass(kw_only=True, slots=True)
class PlanRequest:
    """What ``pystronghold plan`` is asked, in the units people use. Validated on construction."""

    gpu: str | None = field(default=None, metadata={"metavar": "NAME"})
    """GPU preset: v100-16gb, v100-32gb, a100-40gb, a100-80gb, h100-80gb, rtx3090, rtx4090."""
    gpu_memory: float | None = field(default=None, metadata={"metavar": "GB"})
    """Device memory in GiB of a GPU without a preset (with --gpu-tflops), or overriding the preset's."""
    gpu_tflops: float | None = None
    """Dense TFLOP/s in the chosen precision of a GPU without a preset, or overriding the preset's."""
    link_bandwidth: float | None = field(default=None, metadata={"metavar": "GB/S"})
    """Host<->device bandwidth per direction, GB/s (default: the preset's, else 25, PCIe gen4)."""
    host_memory: float | None = field(default=None, metadata={"metavar": "GB"})
    """Host memory for the store, GiB (required)."""
    cpu_adam_rate: float = 2.0
    """Fused CPU AdamW speed of the whole host, billions of parameters per second (measure yours
    with bench/adam.py)."""
    nvme: float = field(default=0.0, metadata={"metavar": "GB"})
    """NVMe space for optimizer states when host memory is short, GiB (0: none)."""
    nvme_bandwidth: float = field(default=3.0, metadata={"metavar": "GB/S"})
    """NVMe read/write bandwidth, GB/s."""
    model: str | None = field(default=None, metadata={"metavar": "PRESET"})
    """GPT preset (tiny, mini, small, gpt2-124m, gpt3-125m ... gpt3-175b); or give --layers,
    --hidden, --heads."""
    layers: int | None = None
    """Transformer blocks (overrides the preset's)."""
    hidden: int | None = None
    """Width (overrides the preset's)."""
    heads: int | None = None
    """Attention heads (overrides the preset's)."""
    vocab: int = 50257
    """Vocabulary of a model given by --layers/--hidden/--heads (padded to a multiple of 128)."""
    seq: int | None = None
    """Tokens per sample (default: the model's context, 2048 without a preset)."""
    batch: int = 1
    """Micro-batch per rank, samples."""
    efficiency: float = 0.5
    """Fraction of the peak FLOP/s a block reaches."""
    tp: int = 1
    """Tensor-parallel ranks."""
    dp: int = 1
    """Data-parallel ranks (all tp * dp ranks on this one host)."""
    overlap: str = field(default="backward", metadata={"choices": ("backward", "forward")})
    """Host updates during backward, or after it (forward; what clipping and fp16 need)."""
    widths: str | None = field(default=None, metadata={"metavar": "C,C,..."})
    """Comma-separated widths of the largest-model table (default: the model's, 2048 ... 16384)."""
    json: bool = False
    """Print one JSON object (bytes, seconds) instead of tables."""
    runtime: RuntimeConfig = component(lambda: RuntimeConfig(**PLAN_RUNTIME_DEFAULTS),
                                       only=("window", "resident_blocks", "precision", "checkpointing"))
    """The runtime settings the plan assumes"""

    def __post_init__(self) -> None:
        if self.gpu is not None:  # first: a misspelt GPU is the error to report, not a missing option
            from pystronghold.planner.hardware import gpu_preset

            gpu_preset(self.gpu)
        if self.gpu is None and self.gpu_memory is None and self.gpu_tflops is None:
            raise ValueError("give --gpu NAME, or --gpu-memory GB and --gpu-tflops X")
        if self.gpu is None and (self.gpu_memory is None or self.gpu_tflops is None):
            raise ValueError("a GPU without a preset needs both --gpu-memory and --gpu-tflops")
        if self.host_memory is None:
            raise ValueError("--host-memory GB is required")
        if self.model is None and None in (self.layers, self.hidden, self.heads):
            raise ValueError("give --model PRESET, or --layers, --hidden and --heads")
        for name in ("gpu_memory", "gpu_tflops", "link_bandwidth", "host_memory", "cpu_adam_rate",
                     "nvme_bandwidth", "efficiency", "layers", "hidden", "heads", "vocab", "seq",
                     "batch", "tp", "dp"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if not (math.isfinite(self.nvme) and self.nvme >= 0):
            raise ValueError(f"--nvme must be >= 0 GiB, got {self.nvme}")
        if self.efficiency > 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {self.efficiency}")
        if self.widths is not None:
            try:
                widths = [int(w) for w in self.widths.split(",")]
            except ValueError:
                raise ValueError(f"--widths must be comma-separated integers, got {self.widths!r}") from None
            if min(widths) < 1:
                raise ValueError(f"--widths must be positive, got {self.widths!r}")

    def resolve(self):
        """(GPTConfig, Workload, Hardware, window or None, widths or None, resident blocks or None);
        ValueError on bad values."""
        from pystronghold.models.gpt import GPTConfig
        from pystronghold.models.presets import PRESETS
        from pystronghold.planner.cost import Workload
        from pystronghold.planner.hardware import GB, GPU, PCIE_GEN4, GiB, TFLOPS, Hardware, gpu_preset

        if self.gpu is not None:
            gpu = gpu_preset(self.gpu)
            if self.gpu_memory is not None:
                gpu.memory_bytes = int(self.gpu_memory * GiB)
            if self.gpu_tflops is not None:
                gpu.fp32_flops = gpu.fp16_flops = self.gpu_tflops * TFLOPS
                gpu.bf16_flops = self.gpu_tflops * TFLOPS
        else:
            flops = self.gpu_tflops * TFLOPS
            gpu = GPU(name=f"custom-{self.gpu_memory:g}gb", memory_bytes=int(self.gpu_memory * GiB),
                      fp32_flops=flops, bf16_flops=flops, fp16_flops=flops,
                      h2d_bytes_per_s=PCIE_GEN4, d2h_bytes_per_s=PCIE_GEN4)
        if self.link_bandwidth is not None:
            gpu.h2d_bytes_per_s = gpu.d2h_bytes_per_s = self.link_bandwidth * GB
        hw = Hardware(gpu=gpu, host_memory_bytes=int(self.host_memory * GiB),
                      cpu_adam_params_per_s=self.cpu_adam_rate * 1e9, nvme_bytes=int(self.nvme * GiB),
                      nvme_bytes_per_s=self.nvme_bandwidth * GB)
        if self.model is not None:
            if self.model not in PRESETS:
                raise ValueError(f"unknown model preset {self.model!r}; known: {', '.join(PRESETS)}")
            base = PRESETS[self.model]
            shape = {k: v for k, v in dict(layers=self.layers, hidden=self.hidden, heads=self.heads).items()
                     if v is not None}
            config = dataclasses.replace(base, tp_size=self.tp, **shape)
        else:
            config = GPTConfig(vocab_size=self.vocab, vocab_pad_multiple=128, seq_len=self.seq or 2048,
                               layers=self.layers, hidden=self.hidden, heads=self.heads,
                               tie_embeddings=True, tp_size=self.tp)
        if self.seq is not None and self.seq > config.seq_len:
            config = dataclasses.replace(config, seq_len=self.seq)
        rt = self.runtime
        work = Workload(batch=self.batch, seq=self.seq, precision=rt.precision,
                        checkpointing=rt.checkpointing, dp_size=self.dp, overlap=self.overlap,
                        compute_efficiency=self.efficiency)
        hw.gpu.flops(rt.precision)  # refuses bf16 on a GPU without it
        window = {"auto": None, "all": config.layers}.get(rt.window, rt.window)
        widths = None if self.widths is None else [int(w) for w in self.widths.split(",")]
        resident = None if rt.resident_blocks == "auto" else rt.resident_blocks
        if resident is not None and resident > config.layers:
            raise ConfigError(rt, "resident_blocks",
                              f"({resident}) is more than the model's {config.layers} blocks")
        return config, work, hw, window, widths, resident


def run_plan(args: argparse.Namespace) -> int:
    """Run ``pystronghold plan``: 0 when the model fits, 1 when it does not, 2 on bad input."""
    from pystronghold.planner.plan import largest_models, make_plan
    from pystronghold.planner.report import format_plan, plan_to_dict

    try:
        request = from_args(PlanRequest, args)
        config, work, hw, window, widths, resident = request.resolve()
        plan = make_plan(config, work, hw, window, resident)
        plan.largest = largest_models(config, work, hw, widths)
    except ValueError as e:
        message = e.on_command_line() if isinstance(e, ConfigError) else str(e)
        print(f"pystronghold plan: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(plan), indent=2) if request.json else format_plan(plan))
    return 0 if plan.fits else 1


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``pystronghold`` subcommands; returns its parser."""
    parser = subparsers.add_parser(
        "plan", help="window, memory, step time and the largest model for a GPU and host (no GPU needed)",
        description="Predict what training a GPT with the layer window needs and how fast it runs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, PlanRequest)

    def one_line_error(message: str):
        print(f"pystronghold plan: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # NOTE: argparse's usage dump is not a one-line error
    parser.set_defaults(run=run_plan)
    return parser
