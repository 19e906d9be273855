"""``pystronghold plan``: the request dataclass, the argparse parser generated from it, the command.

Every field of ``PlanRequest`` becomes one option (``gpu_memory`` -> ``--gpu-memory``;
``pystronghold.options``): its type comes from the annotation, its help from the docstring under
the field, choices from the field's metadata. The runtime settings the plan assumes (--window,
--resident-blocks, --precision, --checkpointing, --accumulation, --schedule) are ``RuntimeConfig``'s
fields, declared and validated there. Sizes are in GiB (2**30 bytes) and bandwidths in GB/s (1e9
bytes/s), as people say them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field

from pystronghold.models.hf import HF_PREFIX, NO_POSITION_LIMIT
from pystronghold.options import ConfigError, add_options, component, from_args, one_line_error, option
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.settings.finetune import FinetuneOptions
from pystronghold.settings.parallel import ParallelOptions

__all__ = ["PlanRequest", "PLAN_RUNTIME_DEFAULTS", "add_plan_command", "run_plan"]

log = logging.getLogger(__name__)

EXAMPLES = """examples:
  pystronghold plan --gpu a100-40gb --host-memory 256 --model gpt3-6.7b --batch 4 --precision bf16
  pystronghold plan --gpu auto --model gpt3-1.3b        # this machine's GPU and RAM
  pystronghold plan --gpu rtx4090 --host-memory 128 --nvme 2000 --layers 48 --hidden 6144 --heads 48
  pystronghold plan --gpu-memory 24 --gpu-tflops 100 --host-memory 64 --model gpt3-2.7b --window 4 --json
  pystronghold plan --gpu h100-80gb --host-memory 512 --model gpt3-13b --pp 4 --tp 2 --micro-batches 8
  pystronghold plan --cluster cluster.yaml --model gpt3-350m --global-batch 512 --precision fp32
  pystronghold plan --gpu h100-80gb --host-memory 125 --model hf:bench/models/llama-3-70b --seq 4096 --lora-rank 16 --precision bf16
  pystronghold plan --gpu rtx4090 --host-memory 64 --model gpt3-2.7b --freeze 'head|ln|attn'
  pystronghold plan --gpu h100-80gb --host-memory 2048 --model hf:bench/models/llama-3-70b --tp 8 --pp 2 --dp 1 --seq 4096 --precision bf16
exit status: 0 the model fits, 1 it does not (the report says why), 2 bad arguments."""


PLAN_RUNTIME_DEFAULTS = {"window": "auto", "resident_blocks": "auto", "schedule": "auto"}
"""Where ``pystronghold plan``'s runtime defaults differ from ``RuntimeConfig``'s: it picks K and W and
the accumulation schedule unless told otherwise. The precision is ``train``'s (``RuntimeConfig``)."""


@dataclass(kw_only=True, slots=True)
class PlanRequest:
    """What ``pystronghold plan`` is asked, in the units people use. Validated on construction."""

    gpu: str | None = field(default=None, metadata={"metavar": "NAME"})
    """GPU preset: v100-16gb, v100-32gb, v100-pcie-32gb, p100-16gb, p100-pcie-16gb, a100-40gb,
    a100-80gb, h100-80gb, h200-141gb, gh200-96gb, b200-180gb, l40s-48gb, rtx3090, rtx4090, rtx5090,
    rtx-pro-6000; or auto: this machine's CUDA device (its preset, the memory it reports)."""
    gpu_memory: float | None = field(default=None, metadata={"metavar": "GB"})
    """Device memory in GiB of a GPU without a preset (with --gpu-tflops), or overriding the preset's."""
    gpu_tflops: float | None = None
    """Dense TFLOP/s in the chosen precision of a GPU without a preset, or overriding the preset's."""
    link_bandwidth: float | None = field(default=None, metadata={"metavar": "GB/S"})
    """Host<->device bandwidth per direction, GB/s (default: the preset's, else 25, PCIe gen4)."""
    host_memory: float | None = field(default=None, metadata={"metavar": "GB"})
    """Host memory of the machine planned, GiB (default: this machine's RAM)."""
    cpu_adam_rate: float = 2.0
    """Fused CPU AdamW speed of the whole host, billions of parameters per second (measure yours
    with bench/adam.py)."""
    nvme: float = field(default=0.0, metadata={"metavar": "GB"})
    """NVMe space for optimizer states when host memory is short, GiB (0: none)."""
    nvme_bandwidth: float = field(default=3.0, metadata={"metavar": "GB/S"})
    """NVMe read/write bandwidth, GB/s."""
    model: str | None = field(default=None, metadata={"metavar": "PRESET"})
    """GPT preset (tiny, mini, small, gpt2-124m, gpt3-125m ... gpt3-175b), or hf:DIR, a Hugging Face
    model directory (only its config.json is read; needs transformers; bench/models/llama-3-70b is
    Llama 3 70B's); or give --layers, --hidden, --heads."""
    layers: int | None = None
    """Transformer blocks (overrides the preset's)."""
    hidden: int | None = None
    """Width (overrides the preset's)."""
    heads: int | None = None
    """Attention heads (overrides the preset's)."""
    vocab: int = 50257
    """Vocabulary of a model given by --layers/--hidden/--heads (padded to a multiple of 128)."""
    seq: int | None = None
    """Tokens per sample (default: the model's context, 2048 without a preset; hf:DIR: its positions
    capped by what fits, as train takes them)."""
    batch: int = 1
    """Micro-batch per rank, samples."""
    efficiency: float = 0.5
    """Fraction of the peak FLOP/s a block reaches."""
    overlap: str = field(default="backward", metadata={"choices": ("backward", "forward")})
    """Host updates during backward, or after it (forward; what clipping and fp16 need)."""
    widths: str | None = field(default=None, metadata={"metavar": "C,C,..."})
    """Comma-separated widths of the largest-model table (default: the model's, 2048 ... 16384)."""
    json: bool = False
    """Print one JSON object (bytes, seconds) instead of tables."""
    cluster: str | None = option(None, metavar="PATH")
    """Cluster file of unlike GPUs (JSON, or YAML with PyYAML): search TP/PP/DP, stage and batch
    splits and each piece's window over it and print the best layouts (replaces --gpu and
    --host-memory)."""
    global_batch: int | None = option(None)
    """Samples per step over all ranks, with --cluster (default: --batch x the devices)."""
    # NOTE: LoRA's alpha and dropout change no byte or FLOP: options of train only
    finetune: FinetuneOptions = component(FinetuneOptions, only=("lora_rank", "lora_targets", "freeze"))
    """What trains"""
    parallel: ParallelOptions = component(lambda: ParallelOptions(dp=1), only=(
        "tp", "dp", "pp", "micro_batches", "pp_schedule", "pp_chunks"))
    """The parallel layout planned (the tp x dp ranks on this one host; each pipeline stage on a host
    of its own, the window, memory and step time then the largest stage's; --batch is one
    micro-batch)"""
    runtime: RuntimeConfig = component(lambda: RuntimeConfig(**PLAN_RUNTIME_DEFAULTS),
                                       only=("window", "resident_blocks", "precision", "checkpointing",
                                             "accumulation_steps", "schedule"))
    """The runtime settings the plan assumes"""

    def __post_init__(self) -> None:
        if self.cluster is not None:
            if self.gpu is not None or self.gpu_memory is not None or self.host_memory is not None:
                raise ConfigError(self, "cluster", "gives the devices and host memory: drop `gpu`, "
                                  "`gpu_memory` and `host_memory`")
            if self.runtime.window != "auto":
                raise ConfigError(self, "cluster", "picks each piece's window itself: leave the window at "
                                  f"auto (got {self.runtime.window!r})")
        elif self.global_batch is not None:
            raise ConfigError(self, "global_batch", "is the step of a cluster plan: give `cluster` too")
        if self.global_batch is not None and self.global_batch < 1:
            raise ConfigError(self, "global_batch=", "must be a positive number of samples")
        if self.cluster is None:
            if self.gpu not in (None, "auto"):  # first: a misspelt GPU is the error to report, not a missing option
                from pystronghold.planner.hardware import gpu_preset

                gpu_preset(self.gpu)
        missing = []  # every option missing, in one line
        if self.cluster is None:
            if self.gpu is None and self.gpu_memory is None and self.gpu_tflops is None:
                missing.append("--gpu NAME (or --gpu-memory GB and --gpu-tflops X)")
            elif self.gpu is None and (self.gpu_memory is None or self.gpu_tflops is None):
                missing.append(f"--{'gpu-tflops X' if self.gpu_tflops is None else 'gpu-memory GB'} "
                               "(a GPU without a preset needs both --gpu-memory and --gpu-tflops)")
        if self.model is None and None in (self.layers, self.hidden, self.heads):
            missing.append("--model PRESET (or --layers, --hidden and --heads)")
        if missing:
            raise ValueError("give " + " and ".join(missing))
        for name in ("gpu_memory", "gpu_tflops", "link_bandwidth", "host_memory", "cpu_adam_rate",
                     "nvme_bandwidth", "efficiency", "layers", "hidden", "heads", "vocab", "seq",
                     "batch"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
        if not (math.isfinite(self.nvme) and self.nvme >= 0):
            raise ValueError(f"--nvme must be >= 0 GiB, got {self.nvme}")
        if self.efficiency > 1:
            raise ValueError(f"--efficiency must be in (0, 1], got {self.efficiency}")
        if self.model is not None and self.model.startswith(HF_PREFIX):
            for name in ("hidden", "heads", "widths"):
                if getattr(self, name) is not None:
                    raise ConfigError(self, name, f"does not apply to a Hugging Face model (`model`): "
                                      "its config.json gives the shape")
        if self.widths is not None:
            try:
                widths = [int(w) for w in self.widths.split(",")]
            except ValueError:
                raise ValueError(f"--widths must be comma-separated integers, got {self.widths!r}") from None
            if min(widths) < 1:
                raise ValueError(f"--widths must be positive, got {self.widths!r}")

    def model_config(self):
        """The GPTConfig of --model (or --layers/--hidden/--heads) at --tp and --seq; the
        ``HFShape`` of --model hf:DIR at --tp (at --layers when given; a --tp that train refuses is
        refused in train's words)."""
        from pystronghold.models.gpt import GPTConfig
        from pystronghold.models.presets import PRESETS

        if self.model is not None and self.model.startswith(HF_PREFIX):
            from pystronghold.planner.hf_shape import read_hf_shape

            shape = read_hf_shape(self.model[len(HF_PREFIX):])
            return dataclasses.replace(shape, tp_size=self.parallel.tp, layers=self.layers or shape.layers)
        if self.model is not None:
            if self.model not in PRESETS:
                raise ValueError(f"unknown model preset {self.model!r}; known: {', '.join(PRESETS)}")
            base = PRESETS[self.model]
            shape = {k: v for k, v in dict(layers=self.layers, hidden=self.hidden, heads=self.heads).items()
                     if v is not None}
            config = dataclasses.replace(base, tp_size=self.parallel.tp, **shape)
        else:
            config = GPTConfig(vocab_size=self.vocab, vocab_pad_multiple=128, seq_len=self.seq or 2048,
                               layers=self.layers, hidden=self.hidden, heads=self.heads,
                               tie_embeddings=True, tp_size=self.parallel.tp)
        if self.seq is not None and self.seq > config.seq_len:
            config = dataclasses.replace(config, seq_len=self.seq)
        return config

    def resolve(self):
        """(GPTConfig, Workload, Hardware, window or None, widths or None, resident blocks or None);
        ValueError on bad values."""
        from pystronghold.planner.cost import Workload
        from pystronghold.planner.hardware import (GB, GPU, PCIE_GEN4, GiB, TFLOPS, Hardware, gpu_preset,
                                                   local_gpu, local_host_memory_bytes)

        if self.gpu is not None:
            gpu = local_gpu(self.gpu_tflops) if self.gpu == "auto" else gpu_preset(self.gpu)
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
        host = local_host_memory_bytes() if self.host_memory is None else int(self.host_memory * GiB)
        hw = Hardware(gpu=gpu, host_memory_bytes=host,
                      cpu_adam_params_per_s=self.cpu_adam_rate * 1e9, nvme_bytes=int(self.nvme * GiB),
                      nvme_bytes_per_s=self.nvme_bandwidth * GB)
        config = self.model_config()
        rt = self.runtime
        seq = self.seq
        work = Workload(batch=self.batch, seq=seq, precision=rt.precision,
                        checkpointing=rt.checkpointing, dp_size=self.parallel.dp_size, overlap=self.overlap,
                        compute_efficiency=self.efficiency, finetune=self.finetune)
        if seq is None and self.model is not None and self.model.startswith(HF_PREFIX):  # as train runs it
            from pystronghold.planner.sequence import default_context

            positions = None if config.seq_len == NO_POSITION_LIMIT else config.seq_len
            work = dataclasses.replace(work, seq=default_context(config, work, hw, positions)[0])
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
    from pystronghold.planner.hardware import format_bytes
    from pystronghold.planner.pipeline import link_bytes, plan_pipeline
    from pystronghold.planner.plan import largest_models, make_plan
    from pystronghold.planner.relay import schedule_report
    from pystronghold.planner.report import format_plan, plan_to_dict
    from pystronghold.planner.sequence import choose_sequence_settings, longest_context
    from pystronghold.planner.trainable import check_freeze

    try:
        request = from_args(PlanRequest, args)
        if request.cluster is not None:
            from pystronghold.planner.hetero import run_cluster_plan

            return run_cluster_plan(request)
        config, work, hw, window, widths, resident = request.resolve()
        check_freeze(config, work.finetune)
        pipeline, par = None, request.parallel
        whole = config  # the model before a pipeline narrows it to its largest stage
        if par.pp > 1:
            pipeline = plan_pipeline(config, work, par.pp, par.micro_batch_count, par.pp_schedule, par.pp_chunks)
            # NOTE: an upper bound over the stages: the most blocks of any stage, holding the
            # activations of the most micro-batches in flight on any stage (stage 0's under 1F1B)
            config = dataclasses.replace(config, layers=max(pipeline.stage_blocks(s) for s in range(par.pp)))
        in_flight = max(pipeline.stage_in_flight(s) for s in range(par.pp)) if pipeline else 1
        plan = make_plan(config, work, hw, window, resident, in_flight=in_flight)
        if pipeline is None:  # the long-context settings train would apply, and the longest context
            if not plan.fits:
                settings = choose_sequence_settings(config, work, hw, work.seq or config.seq_len)
                if settings.fits:
                    work = settings.workload(work)
                    plan = make_plan(config, work, hw, window, resident)
            plan.longest = longest_context(config, work, hw)
        plan.largest = largest_models(config, work, hw, widths)
        links = link_bytes(whole, work, pipeline, plan.recomputed_blocks)
    except ValueError as e:
        message = e.on_command_line() if isinstance(e, ConfigError) else str(e)
        print(f"pystronghold plan: error: {message}", file=sys.stderr)
        return 2
    record, text = plan_to_dict(plan), format_plan(plan) + "\n" + links.line()
    record["links"] = links.to_dict()
    record["hardware"]["host_memory_from"] = "this machine" if request.host_memory is None else "--host-memory"
    if request.host_memory is None:
        text = (f"host memory: {format_bytes(hw.host_memory_bytes)} (this machine; --host-memory GB plans "
                "another)\n" + text)
    if pipeline is not None:
        record["pipeline"] = pipeline.to_dict()
        lines = pipeline.lines() + [
            f"  (window, memory and step time above: the largest stage, {config.layers} blocks, with "
            f"both head and tail counted and the activations of {in_flight} micro-batches "
            "in flight, for one micro-batch)"]
        if plan.step is not None:
            step = pipeline.step_s(plan.step.total_s)
            tokens = pipeline.micro_batches * plan.tokens_per_s * plan.step.total_s / step
            record["pipeline"].update(step_s=step, tokens_per_s=tokens)
            lines.append(f"  pipeline step: {pipeline.micro_batches} micro-batches x the stage's x (1 + bubble) = "
                         f"{step:,.2f} s, {tokens:,.0f} tokens/s")
        text += "\n" + "\n".join(lines)
    elif plan.fits:  # the accumulation schedule (planner/relay.py) of the plan's step
        record["schedule"], lines = schedule_report(plan, request.runtime.accumulation_steps,
                                                    request.runtime.schedule)
        text += "\n" + lines
    print(json.dumps(record, indent=2) if request.json else text)
    return 0 if plan.fits else 1


def add_plan_command(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to the ``pystronghold`` subcommands; returns its parser."""
    parser = subparsers.add_parser(
        "plan", help="window, memory, step time and the largest model for a GPU and host (no GPU needed)",
        description="Predict what training a GPT with the layer window needs and how fast it runs.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, PlanRequest)
    parser.error = one_line_error("pystronghold plan")  # NOTE: argparse's usage dump is not a one-line error
    parser.set_defaults(run=run_plan)
    return parser
