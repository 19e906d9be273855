"""Which AdamW kernel ``DeviceAdamW`` runs (head, tail and resident blocks share the choice): torch's
fused kernel on CUDA, its single-tensor loop elsewhere, and the loop when torch lacks the kernel."""

from __future__ import annotations

import pytest
import torch

import pystronghold as ph
from pystronghold.optim import AdamW, DeviceAdamW
from pystronghold.optim.device_adamw import fused_adamw_for
from runtime_models import tiny_gpt


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cuda:1", True), (torch.device("cuda", 0), True),
                                           ("cpu", False), (torch.device("cpu"), False), ("meta", False)])
def test_fused_on_cuda_only(device, fused):
    assert fused_adamw_for(device) is fused


def test_no_fused_kernel_in_this_torch_keeps_the_loop(monkeypatch):
    monkeypatch.delattr(torch, "_fused_adamw_")
    assert fused_adamw_for("cuda") is False


def test_the_choice_reaches_torch():
    p = torch.nn.Parameter(torch.randn(7))
    for fused in (False, True):
        opt = DeviceAdamW([p], AdamW(lr=1e-3), [p.detach()], fused=fused)
        assert opt._opt.defaults["fused"] is (True if fused else None) and opt._opt.defaults["foreach"] is False


def test_head_tail_and_resident_blocks_on_the_cpu_run_the_loop():
    engine = ph.wrap(tiny_gpt(), window=2, resident_blocks=1)
    try:
        assert engine.device_optimizer.fused is False and engine.resident.optimizer.fused is False
    finally:
        engine.close()
