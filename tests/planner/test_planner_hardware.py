"""GPU presets people have (each plans a model), and ``--gpu auto``: this machine's CUDA device as
its preset with the memory it reports, one line without one. CUDA is mocked where a device is
needed (the device's name and memory are all ``local_gpu`` reads)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pystronghold.cli import main
from pystronghold.options import ConfigError
from pystronghold.planner.command import PlanRequest
from pystronghold.planner.hardware import GB, GPUS, PCIE_GEN5, GiB, gpu_preset, local_gpu

NEW = ("h200-141gb", "gh200-96gb", "b200-180gb", "l40s-48gb", "rtx5090", "rtx-pro-6000")


@pytest.mark.parametrize("name", NEW)
def test_each_new_preset_plans(name, capsys):
    assert main(["plan", "--gpu", name, "--host-memory", "512", "--model", "gpt3-1.3b", "--precision", "bf16",
                 "--widths", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    gpu = GPUS[name]
    assert out["fits"] and out["step"]["total_s"] > 0 and out["hardware"]["gpu"] == name
    assert out["hardware"]["gpu_memory_bytes"] == gpu.memory_bytes and out["hardware"]["gpu_flops"] == gpu.bf16_flops


def test_preset_figures():
    """A few of the vendor figures, and what follows from them: the H200 at the 139 GiB CUDA
    reports, GH200's host link (NVLink-C2C) far faster than PCIe gen5, B200 past 2 PFLOP/s bf16."""
    assert GPUS["h200-141gb"].memory_bytes == 139 * GiB
    assert GPUS["gh200-96gb"].h2d_bytes_per_s == GPUS["gh200-96gb"].d2h_bytes_per_s == 360 * GB > 7 * PCIE_GEN5
    assert GPUS["b200-180gb"].bf16_flops == 2250e12 and GPUS["b200-180gb"].memory_bytes == 180 * GiB
    assert GPUS["l40s-48gb"].memory_bytes_per_s == 864 * GB and GPUS["rtx5090"].memory_bytes == 32 * GiB


def test_gpu_auto_without_cuda_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    assert main(["plan", "--gpu", "auto", "--host-memory", "64", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "--gpu auto: no CUDA device here" in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_planner_options_are_config_errors_in_python_too(monkeypatch):
    """The one type a caller of the Python API catches for a bad option: the request's own checks
    name its fields, the layers' name the flag."""
    with pytest.raises(ConfigError, match=r"^PlanRequest.gpu_memory must be a positive number, got -1$"):
        PlanRequest(gpu="h100-80gb", host_memory=64, model="tiny", gpu_memory=-1)
    with pytest.raises(ConfigError, match=r"^unknown model preset 'gpt9'; known: tiny, "):
        PlanRequest(gpu="h100-80gb", host_memory=64, model="gpt9").model_config()
    with pytest.raises(ConfigError, match=r"^unknown GPU 'h7'; known: "):
        gpu_preset("h7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--gpu auto: no CUDA device here"):
        local_gpu()


def _device(monkeypatch, name: str, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name=name, total_memory=total))


@pytest.mark.parametrize("device,total,preset", [
    ("NVIDIA H200", 139 * GiB + 5 * 2**20, "h200-141gb"),
    ("NVIDIA GH200 480GB", 95 * GiB, "gh200-96gb"),
    ("NVIDIA H100 80GB HBM3", 79 * GiB, "h100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 39 * GiB, "a100-40gb"),
    ("Tesla V100-PCIE-32GB", 31 * GiB, "v100-pcie-32gb"),
    ("NVIDIA GeForce RTX 5090", 31 * GiB, "rtx5090"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 95 * GiB, "rtx-pro-6000"),
])
def test_gpu_auto_reads_the_device(monkeypatch, device, total, preset):
    _device(monkeypatch, device, total)
    gpu = local_gpu()
    assert gpu.name == f"{preset} ({device})" and gpu.memory_bytes == total
    assert (gpu.bf16_flops, gpu.h2d_bytes_per_s) == (GPUS[preset].bf16_flops, GPUS[preset].h2d_bytes_per_s)


def test_gpu_auto_on_a_device_without_a_preset(monkeypatch, capsys):
    _device(monkeypatch, "NVIDIA Some Future GPU", 200 * GiB)
    assert main(["plan", "--gpu", "auto", "--host-memory", "64", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA Some Future GPU has no preset; give its dense TFLOP/s with --gpu-tflops X" in err
    assert err.count("\n") == 1
    assert main(["plan", "--gpu", "auto", "--gpu-tflops", "100", "--host-memory", "64", "--model", "gpt3-1.3b",
                 "--widths", "2048", "--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert (hardware["gpu"], hardware["gpu_memory_bytes"], hardware["gpu_flops"]) == (
        "NVIDIA Some Future GPU", 200 * GiB, 100e12)
