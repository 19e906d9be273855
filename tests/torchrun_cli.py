"""`pystronghold train` launched as real processes by torch.distributed.run, and the losses its
metrics lines print: shared by the torchrun CLI tests (TP/DP, pipeline, uneven DP, hf:DIR's layouts)."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

from train_helpers import text_dir

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


@functools.cache
def reference_losses() -> tuple[list[float], list[float]]:
    """The single-process run's (training, validation) losses: what every layout must log. Run once
    per pytest session: every file comparing against it shares the one launch."""
    p = run_train(1)
    assert p.returncode == 0, p.stderr
    train, val = logged_losses(p.stdout)
    assert len(train) == 3 and len(val) == 1
    return train, val


class CheckpointingRuns:
    """``run_train`` launches that write checkpoints at steps 2 and 3, each layout launched once and
    shared by the tests that read its log and those that resume its checkpoints (a launch costs
    seconds of process start-up and gloo set-up). Use from a module-scoped fixture."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.runs = {}

    def __call__(self, nproc: int, *extra: str):
        """(the finished launch, its checkpoint directory) of ``run_train(nproc, *extra)``; the
        directory is shared: a test that changes it works on a copy (``copy_to``)."""
        key = (nproc, extra)
        if key not in self.runs:
            ck = self.tmp_path_factory.mktemp("checkpointing") / "ck"
            p = run_train(nproc, *extra, "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
            self.runs[key] = (p, ck)
        return self.runs[key]

    def copy_to(self, tmp_path, nproc: int, *extra: str) -> str:
        """A copy in ``tmp_path`` of the checkpoint directory ``self(nproc, *extra)`` wrote (it exited 0)."""
        import shutil

        p, ck = self(nproc, *extra)
        assert p.returncode == 0, p.stderr
        return str(shutil.copytree(ck, tmp_path / "ck"))


# ---- a Hugging Face model (hf:DIR) under torchrun, losses read exactly from --metrics-file

HF_TIMEOUT_S = 240


_ONE_PROCESS_RUNS: dict = {}
"""One-process ``run_hf`` launches by (the bytes of the model and data files, the arguments): the
reference run of a family recurs in several tests (PP2, TP2 x PP2, two nodes) and files."""

_OUTPUT_OPTIONS = ("--checkpoint-dir", "--trace", "--tensorboard")


def _contents(*directories) -> str:
    import hashlib

    digest = hashlib.sha256()
    for directory in directories:
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_hf(tmp_path, directory, name: str, nproc: int, *extra: str, nodes: int = 1):
    """``train`` on the Hugging Face model in ``directory`` for 3 steps: one process (``nproc`` 1) or
    ``nproc`` ranks under torchrun, on ``nodes`` "nodes" (torchrun launches of ``nproc`` ranks each,
    joined by a c10d rendezvous on localhost). Returns (rank 0's launch, its metrics records).

    A one-process run writing no outputs but its metrics is launched once per model and data
    contents and arguments in a pytest session; a repeat gets its launch and metrics file again."""
    metrics = tmp_path / f"{name}.jsonl"
    cacheable = nproc == 1 and not any(option in extra for option in _OUTPUT_OPTIONS)
    if cacheable:
        key = (_contents(directory, text_dir(tmp_path)), extra)
        if key in _ONE_PROCESS_RUNS:
            p, text = _ONE_PROCESS_RUNS[key]
            metrics.write_text(text)
            return p, [json.loads(line) for line in text.splitlines()]
    first, records = _launch_hf(tmp_path, directory, metrics, name, nproc, *extra, nodes=nodes)
    if cacheable:
        _ONE_PROCESS_RUNS[key] = (first, metrics.read_text())
    return first, records


def _launch_hf(tmp_path, directory, metrics, name: str, nproc: int, *extra: str, nodes: int = 1):
    args = ["--model", f"hf:{directory}", "--data", str(text_dir(tmp_path)), "--steps", "3", "--log-every", "1",
            "--batch", "4", "--seq", "24", "--max-bytes", "16384", "--eval-batches", "1", "--quiet",
            "--window", "1", "--lr", "3e-3", "--metrics-file", str(metrics), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nproc == 1:
        env.pop("WORLD_SIZE", None)
        launches = [[sys.executable, "-m", "pystronghold", "train", *args]]
    elif nodes == 1:
        launches = [[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                     "-m", "pystronghold", "train", *args]]
    else:
        from pystronghold.parallel.groups import free_local_port

        # NOTE: under c10d the rendezvous, not --node-rank, orders the nodes: either launch may hold rank 0
        endpoint = f"127.0.0.1:{free_local_port()}"
        launches = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
                     str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name,
                     "--local-addr", "127.0.0.1", "-m", "pystronghold", "train", *args] for _ in range(nodes)]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
               for cmd in launches]
    done = []
    try:
        for proc in running:
            out, err = proc.communicate(timeout=HF_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
    first = max(done, key=lambda p: len(p.stdout))  # only rank 0 logs
    return first, [json.loads(line) for line in metrics.read_text().splitlines()]


def metrics_losses(records: list) -> list[float]:
    """The training losses then the validation loss of a run's --metrics-file records."""
    return [r["loss"] if "loss" in r else r["val_loss"] for r in records]


def assert_losses_close(got: list[float], want: list[float], rtol: float = 1e-5, count: int = 4) -> None:
    """``count`` losses each, every one within ``rtol`` relative of ``want``'s."""
    assert len(got) == len(want) == count and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want)), (got, want)
