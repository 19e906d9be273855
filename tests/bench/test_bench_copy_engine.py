"""bench/copy_engine.py --device cuda on a machine without CUDA: one clear line, exit status 1."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "copy_engine.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_device_cuda_without_cuda_is_one_clear_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--quick"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda: no usable CUDA device" in lines[0], done.stderr
    assert done.stdout == ""  # nothing measured, no table


def test_device_rejects_unknown_choice():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "tpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "invalid choice: 'tpu'" in done.stderr, done.stderr
