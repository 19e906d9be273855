"""What the planner knows about a machine: the accelerator (``GPU``) and its host (``Hardware``).

Units: bytes, bytes/s, FLOP/s; ``GiB = 2**30`` bytes, bandwidths in decimal GB/s. GPU presets
carry the vendor's dense peak FLOP/s and a practical host-link bandwidth (about 75-80% of the PCIe
signalling rate), the same in each direction: H2D and D2H are two independent links.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from pystronghold.options import ConfigError

__all__ = ["GiB", "GB", "TFLOPS", "format_bytes", "GPU", "Hardware", "GPUS", "PCIE_GEN3", "PCIE_GEN4", "PCIE_GEN5",
           "DEFAULT_CPU_ADAM_RATE", "DEFAULT_NVME_BANDWIDTH", "DEFAULT_DEVICE_MEMORY_BANDWIDTH", "gpu_preset",
           "local_host_memory_bytes", "local_gpu"]

GiB = 2**30
"""Bytes in a GiB."""
GB = 1e9
"""Bytes in a (decimal) GB, the unit of bandwidths."""
TFLOPS = 1e12
"""FLOP/s in a TFLOP/s."""


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches (B, KiB, MiB, GiB), one decimal: what the
    plan and the training log print (a small model's 3.2 MiB is not 0.0 GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{int(n)} B"

# Practical per-direction bandwidth of a PCIe x16 link with pinned host memory, bytes/s:
# ~80% of the signalling rate (15.75 / 31.5 / 63 GB/s), what bandwidthTest-style measurements show.
PCIE_GEN3 = 12 * GB
PCIE_GEN4 = 25 * GB
PCIE_GEN5 = 50 * GB

DEFAULT_CPU_ADAM_RATE = 2e9
"""Parameters/s a fused CPU AdamW updates, when not measured. The update is memory bound: per
parameter it reads master, grad, exp_avg, exp_avg_sq (4 + 2..4 + 4 + 4 bytes) and writes master,
exp_avg, exp_avg_sq, shadow (4 + 4 + 4 + 2 bytes), about 28-32 bytes. 2e9 parameters/s is ~60 GB/s
of memory traffic, what one socket of a current server (8 DDR4-3200 / DDR5 channels, 200-300 GB/s
peak) sustains for such streams with OpenMP. A desktop (2 channels, ~50-80 GB/s peak) reaches less:
measure yours (``bench/adam.py``) and pass it as ``cpu_adam_params_per_s``."""

DEFAULT_DEVICE_MEMORY_BANDWIDTH = 1000 * GB
"""Device memory bytes/s of a GPU without a preset: about a current consumer card's (GDDR6X ~1 TB/s);
data-centre parts have 1.5-3.4 TB/s (HBM2e/HBM3)."""

DEFAULT_NVME_BANDWIDTH = 3 * GB
"""Bytes/s of the NVMe tier when not given: a PCIe gen4 x4 SSD streams 5-7 GB/s sequential reads
(vendor datasheets), less when reads and writes interleave; 3 GB/s is a conservative default."""


@dataclass(kw_only=True, slots=True)
class GPU:
    """One accelerator: memory, dense peak FLOP/s by precision, host link, interconnect."""

    name: str
    """Preset name, e.g. ``a100-40gb``."""
    memory_bytes: int
    """Device memory, bytes."""
    fp32_flops: float
    """Dense fp32 peak, FLOP/s (no TF32: PyTorch's default for fp32 matmuls)."""
    bf16_flops: float | None
    """Dense bf16 tensor-core peak with fp32 accumulation, FLOP/s; None: bf16 unsupported."""
    fp16_flops: float
    """Dense fp16 tensor-core peak with fp32 accumulation, FLOP/s."""
    h2d_bytes_per_s: float
    """Practical host-to-device copy bandwidth, bytes/s."""
    d2h_bytes_per_s: float
    """Practical device-to-host copy bandwidth, bytes/s."""
    interconnect_bytes_per_s: float = PCIE_GEN4
    """GPU-to-GPU bandwidth per direction for tensor/data-parallel collectives, bytes/s
    (NVLink where the card has it, else the PCIe link)."""
    memory_bytes_per_s: float = DEFAULT_DEVICE_MEMORY_BANDWIDTH
    """Device memory bandwidth, bytes/s: what the device AdamW of resident blocks streams at."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("GPU.name must not be empty")
        for name in ("memory_bytes", "fp32_flops", "fp16_flops", "h2d_bytes_per_s", "d2h_bytes_per_s",
                     "interconnect_bytes_per_s", "memory_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"GPU.{name} must be a positive number, got {value!r}")
        if self.bf16_flops is not None and not self.bf16_flops > 0:
            raise ValueError(f"GPU.bf16_flops must be positive or None, got {self.bf16_flops!r}")

    def flops(self, precision: str) -> float:
        """Dense peak FLOP/s in ``precision`` ("fp32", "bf16", "fp16"); ValueError if unsupported."""
        if precision == "fp32":
            return self.fp32_flops
        if precision == "fp16":
            return self.fp16_flops
        if precision == "bf16":
            if self.bf16_flops is None:
                raise ValueError(f"{self.name} has no bf16 support; use precision fp16 or fp32")
            return self.bf16_flops
        raise ValueError(f"precision must be one of fp32, bf16, fp16, got {precision!r}")


def _gpu(name: str, mem_gib: float, fp32: float, bf16: float | None, fp16: float, link: float,
         nvlink: float | None = None, *, hbm_gb_s: float) -> GPU:
    return GPU(name=name, memory_bytes=int(mem_gib * GiB), fp32_flops=fp32 * TFLOPS,
               bf16_flops=None if bf16 is None else bf16 * TFLOPS, fp16_flops=fp16 * TFLOPS,
               h2d_bytes_per_s=link, d2h_bytes_per_s=link,
               interconnect_bytes_per_s=link if nvlink is None else nvlink, memory_bytes_per_s=hbm_gb_s * GB)


GPUS: dict[str, GPU] = {g.name: g for g in [
    # Memory bandwidths (hbm_gb_s) from the same datasheets: V100 900 GB/s HBM2; A100 40GB 1555,
    # 80GB 2039 (HBM2e); H100 SXM5 3350 (HBM3); RTX 3090 936, RTX 4090 1008 (GDDR6X).
    # NVIDIA Tesla V100 datasheet (SXM2): fp32 15.7 TFLOPS, tensor fp16 125 TFLOPS, no bf16;
    # PCIe gen3 x16 host link; NVLink 2 300 GB/s total -> 150 GB/s per direction.
    _gpu("v100-16gb", 16, 15.7, None, 125, PCIE_GEN3, 150 * GB, hbm_gb_s=900),
    _gpu("v100-32gb", 32, 15.7, None, 125, PCIE_GEN3, 150 * GB, hbm_gb_s=900),
    # NVIDIA Tesla V100 datasheet (PCIe): fp32 14 TFLOPS, tensor fp16 112 TFLOPS; no NVLink;
    # 900 GB/s HBM2.
    _gpu("v100-pcie-32gb", 32, 14, None, 112, PCIE_GEN3, hbm_gb_s=900),
    # NVIDIA Tesla P100 datasheet (SXM2, NVLink): fp32 10.6, fp16 21.2 TFLOPS (no tensor cores,
    # no bf16); NVLink 1 160 GB/s total -> 80 GB/s per direction; 732 GB/s HBM2.
    _gpu("p100-16gb", 16, 10.6, None, 21.2, PCIE_GEN3, 80 * GB, hbm_gb_s=732),
    # NVIDIA Tesla P100 datasheet (PCIe, 16 GB): fp32 9.3, fp16 18.7 TFLOPS; peers over PCIe gen3;
    # 732 GB/s HBM2.
    _gpu("p100-pcie-16gb", 16, 9.3, None, 18.7, PCIE_GEN3, hbm_gb_s=732),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): fp32 19.5, bf16/fp16 tensor 312 TFLOPS dense;
    # PCIe gen4 x16; NVLink 3 600 GB/s total -> 300 GB/s per direction.
    _gpu("a100-40gb", 40, 19.5, 312, 312, PCIE_GEN4, 300 * GB, hbm_gb_s=1555),
    _gpu("a100-80gb", 80, 19.5, 312, 312, PCIE_GEN4, 300 * GB, hbm_gb_s=2039),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): fp32 67, bf16/fp16 tensor 989 TFLOPS dense
    # (1979 with sparsity); PCIe gen5 x16; NVLink 4 900 GB/s total -> 450 GB/s per direction.
    _gpu("h100-80gb", 80, 67, 989, 989, PCIE_GEN5, 450 * GB, hbm_gb_s=3350),
    # NVIDIA Ampere GA102 whitepaper, GeForce RTX 3090: fp32 35.6, fp16/bf16 tensor with fp32
    # accumulate 71 TFLOPS dense; 24 GB GDDR6X; PCIe gen4 x16; NVLink bridge 112.5 GB/s total.
    _gpu("rtx3090", 24, 35.6, 71, 71, PCIE_GEN4, 56 * GB, hbm_gb_s=936),
    # NVIDIA Ada Lovelace whitepaper, GeForce RTX 4090: fp32 82.6, fp16/bf16 tensor with fp32
    # accumulate 165.2 TFLOPS dense; 24 GB GDDR6X; PCIe gen4 x16; no NVLink (peers over PCIe).
    _gpu("rtx4090", 24, 82.6, 165.2, 165.2, PCIE_GEN4, hbm_gb_s=1008),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, fp32 67, bf16/fp16
    # tensor 989 TFLOPS dense (1979 with sparsity); PCIe gen5; NVLink 4 900 GB/s total. The
    # memory is what CUDA reports on one (139 GiB, torch.cuda.get_device_properties), not 141.
    _gpu("h200-141gb", 139, 67, 989, 989, PCIE_GEN5, 450 * GB, hbm_gb_s=4800),
    # NVIDIA GH200 Grace Hopper Superchip datasheet, 96 GB HBM3 variant: 4 TB/s, fp32 67, bf16/fp16
    # tensor 989 TFLOPS dense; the host link is NVLink-C2C, 900 GB/s total -> 450 per direction,
    # 80% of it practical as for PCIe (360 GB/s); NVLink 4 to other GPUs, 450 GB/s per direction.
    _gpu("gh200-96gb", 96, 67, 989, 989, 0.8 * 450 * GB, 450 * GB, hbm_gb_s=4000),
    # NVIDIA DGX/HGX B200 datasheets, per GPU: 180 GB HBM3e (the 192 GB part has 8 TB/s too),
    # 7.7-8 TB/s, fp32 75, bf16/fp16 tensor 2.25 PFLOPS dense (4.5 with sparsity); PCIe gen5 host
    # link; NVLink 5 1.8 TB/s total -> 900 GB/s per direction.
    _gpu("b200-180gb", 180, 75, 2250, 2250, PCIE_GEN5, 900 * GB, hbm_gb_s=7700),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, fp32 91.6, bf16/fp16 tensor 362.05 TFLOPS
    # dense (733 with sparsity); PCIe gen4 x16; no NVLink.
    _gpu("l40s-48gb", 48, 91.6, 362.05, 362.05, PCIE_GEN4, hbm_gb_s=864),
    # NVIDIA RTX Blackwell GPU architecture whitepaper, GeForce RTX 5090: fp32 104.8, fp16/bf16
    # tensor with fp32 accumulate 209.5 TFLOPS dense; 32 GB GDDR7 at 1792 GB/s; PCIe gen5 x16;
    # no NVLink.
    _gpu("rtx5090", 32, 104.8, 209.5, 209.5, PCIE_GEN5, hbm_gb_s=1792),
    # NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet: 96 GB GDDR7 at 1792 GB/s, fp32
    # 125 TFLOPS, 4000 AI TOPS (fp4 with sparsity) -> bf16/fp16 tensor about 500 TFLOPS dense
    # (fp4 -> fp8 -> fp16 halves twice, sparsity once); PCIe gen5 x16; no NVLink.
    _gpu("rtx-pro-6000", 96, 125, 500, 500, PCIE_GEN5, hbm_gb_s=1792),
]}
"""Built-in GPU presets by name."""

_DEVICE_NAMES = {"v100": ("v100-16gb", "v100-32gb", "v100-pcie-32gb"), "p100": ("p100-16gb", "p100-pcie-16gb"),
                 "a100": ("a100-40gb", "a100-80gb"), "h100": ("h100-80gb",), "h200": ("h200-141gb",),
                 "gh200": ("gh200-96gb",), "b200": ("b200-180gb",), "l40s": ("l40s-48gb",),
                 "rtx 3090": ("rtx3090",), "rtx 4090": ("rtx4090",), "rtx 5090": ("rtx5090",),
                 "rtx pro 6000": ("rtx-pro-6000",)}
"""The presets a CUDA device name may be (``local_gpu``), by the words in it: the longest match
wins (GH200 over H200), then the variant with "pcie" as the name has it, then the closest memory."""


def local_gpu(tflops: float | None = None) -> GPU:
    """The preset of this machine's CUDA device 0 (``--gpu auto``), with the memory CUDA reports;
    a device without a preset needs ``tflops`` (its dense TFLOP/s, every precision). ConfigError,
    one line, without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--gpu auto: no CUDA device here (torch.cuda.is_available() is False); "
                          f"name one: --gpu {', '.join(GPUS)}, or --gpu-memory GB and --gpu-tflops X")
    props = torch.cuda.get_device_properties(0)
    name = props.name.lower().replace("-", " ")
    words = [w for w in _DEVICE_NAMES if w in name]
    if words:
        candidates = _DEVICE_NAMES[max(words, key=len)]
        pcie = [c for c in candidates if ("pcie" in c) == ("pcie" in name)] or list(candidates)
        best = min(pcie, key=lambda c: abs(GPUS[c].memory_bytes - props.total_memory))
        return replace(GPUS[best], name=f"{best} ({props.name})", memory_bytes=int(props.total_memory))
    if tflops is None:
        raise ConfigError(f"--gpu auto: {props.name} has no preset; give its dense TFLOP/s with --gpu-tflops X")
    flops = tflops * TFLOPS
    return GPU(name=props.name, memory_bytes=int(props.total_memory), fp32_flops=flops, bf16_flops=flops,
               fp16_flops=flops, h2d_bytes_per_s=PCIE_GEN4, d2h_bytes_per_s=PCIE_GEN4)


def local_host_memory_bytes() -> int:
    """This machine's RAM, bytes (all of it: what ``--host-memory`` means; the planner keeps its
    own reserve out of it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def gpu_preset(name: str) -> GPU:
    """The preset called ``name`` (case-insensitive); ConfigError listing the known names otherwise."""
    try:
        return replace(GPUS[name.lower()])
    except KeyError:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


@dataclass(kw_only=True, slots=True)
class Hardware:
    """One training machine as the planner sees it: an accelerator plus its host."""

    gpu: GPU
    """The accelerator (per rank)."""
    host_memory_bytes: int
    """Host memory the store may use on this machine, bytes (all ranks of the machine share it)."""
    cpu_adam_params_per_s: float = DEFAULT_CPU_ADAM_RATE
    """Parameters/s of the fused CPU AdamW on this machine's CPUs, shared by its ranks
    (see DEFAULT_CPU_ADAM_RATE)."""
    nvme_bytes: int = 0
    """Disk space for the NVMe tier, bytes; 0: no NVMe tier."""
    nvme_bytes_per_s: float = field(default=DEFAULT_NVME_BANDWIDTH)
    """Read and write bandwidth of the NVMe tier, bytes/s, shared by the machine's ranks."""

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GPU):
            raise ValueError(f"Hardware.gpu must be a GPU, got {self.gpu!r}")
        for name in ("host_memory_bytes", "cpu_adam_params_per_s", "nvme_bytes_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Hardware.{name} must be a positive number, got {value!r}")
        if not (isinstance(self.nvme_bytes, (int, float)) and self.nvme_bytes >= 0):
            raise ValueError(f"Hardware.nvme_bytes must be >= 0, got {self.nvme_bytes!r}")
