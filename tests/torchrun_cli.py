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


def assert_logs_reference(p, reference: tuple[list[float], list[float]], *, from_step: int = 1) -> None:
    """``p`` (a finished run) exited 0 and logged ``reference``'s training losses from step
    ``from_step`` on (a resumed run) and its validation losses: the metrics lines print 4 decimals,
    so equal means |difference| <= 1e-4 (one step moves the loss by ~0.1)."""
    import pytest

    assert p.returncode == 0, p.stderr
    train, val = logged_losses(p.stdout)
    assert train == pytest.approx(reference[0][from_step - 1:], abs=1e-4)
    assert val == pytest.approx(reference[1], abs=1e-4)


def reference_losses() -> tuple[list[float], list[float]]:
    """The single-process run's (training, validation) losses: what every layout must log."""
    p = run_train(1)
    assert p.returncode == 0, p.stderr
    train, val = logged_losses(p.stdout)
    assert len(train) == 3 and len(val) == 1
    return train, val
