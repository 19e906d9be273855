"""`pystronghold train` launched as real processes by torch.distributed.run, and the losses its
metrics lines print: shared by the torchrun CLI tests (TP/DP, pipeline, uneven DP)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ARGS = ["--model", "tiny", "--steps", "3", "--log-every", "1", "--batch", "4", "--seq", "32",
        "--max-bytes", "65536", "--eval-batches", "1", "--quiet"]
TIMEOUT_S = 90


def run_train(nproc: int, *extra: str):
    """`pystronghold train` on the tiny model: one process, or ``nproc`` launched by torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "pystronghold", "train", *ARGS, *extra]
        env.pop("WORLD_SIZE", None)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "pystronghold", "train", *ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)


def logged_losses(stdout: str) -> tuple[list[float], list[float]]:
    """(training, validation) losses of a run's metrics lines."""
    train = [float(x) for x in re.findall(r"^step \d+ \| loss ([0-9.]+)", stdout, re.M)]
    val = [float(x) for x in re.findall(r"^step \d+ \| validation loss ([0-9.]+)", stdout, re.M)]
    return train, val
