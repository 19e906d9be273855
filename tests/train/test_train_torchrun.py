"""``torchrun -m pystronghold train --tp T --dp D``: real processes launched by torch.distributed.run.

TP=2 and DP=2 runs log the losses of the single-process run on the same global batches (fp32; the
metrics lines print 4 decimals, and the printed values must be equal: |difference| <= 1e-4, while
one step moves the loss by ~0.1). The exact-equivalence tests at 1e-5 are in
test_parallel_runtime.py; this file checks the CLI's plumbing: groups, TP shards, DP batch slices,
loss averaging, rank-0 output. Misconfigurations must exit non-zero with one line on stderr from
rank 0 only, within a timeout (no rank left waiting).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torchrun_cli import ARGS, TIMEOUT_S, CheckpointingRuns, assert_logs_reference, reference_losses, run_train
from train_helpers import listing


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


@pytest.fixture(scope="module")
def checkpointing(tmp_path_factory):
    """The --tp 2 and --dp 2 launches, each run once: their logs and their checkpoints are checked apart."""
    return CheckpointingRuns(tmp_path_factory)


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--dp", "2")], ids=["tp2", "dp2"])
def test_two_processes_log_the_single_process_losses(reference, checkpointing, layout):
    p, _ = checkpointing(2, *layout)
    assert_logs_reference(p, reference)
    # rank 0 alone logs: one metrics line per step, one summary
    assert p.stdout.count("trained steps 1..3") == 1


@pytest.mark.parametrize("extra, message", [
    (("--tp", "2"), "--tp 2 must divide the number of processes 3"),
    (("--tp", "3"), "--tp 3 must divide the model's 4 attention heads"),
    (("--dp", "3"), "--batch 4 must be divisible by --dp 3"),
], ids=["world-not-divisible", "heads-not-divisible", "batch-not-divisible"])
def test_misconfiguration_fails_on_every_rank_with_one_message(extra, message):
    p = run_train(3, *extra)  # subprocess.run's timeout: a hang fails the test
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("pystronghold train: error:")]
    assert len(ours) == 1 and message in ours[0]  # printed by rank 0 only
    assert "exitcode: 2" in p.stderr  # our exit status, not a crash (torchrun reports the first failure)
    # NOTE: torchrun itself prints its ChildFailedError traceback; no rank prints one
    assert "pystronghold/" not in p.stderr.replace("pystronghold/.venv", "")


def test_rank_0_reports_even_when_it_starts_last(tmp_path):
    """Rank 0 reaches the check seconds after the others (as under load): its line is still printed,
    and torchrun reports its exit status, not a silent rank's."""
    late_rank_0 = tmp_path / "late_rank_0.py"
    late_rank_0.write_text("import os, sys, time\n"
                           "if os.environ['RANK'] == '0':\n    time.sleep(5)\n"
                           "from pystronghold.cli import main\nsys.exit(main())\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(late_rank_0), "train", *ARGS, "--tp", "3"],
                       capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    ours = [line for line in p.stderr.splitlines() if line.startswith("pystronghold train: error:")]
    assert ours == ["pystronghold train: error: --tp 3 must divide the number of processes 2"], p.stderr
    assert "exitcode: 2" in p.stderr


def test_a_rank_failing_alone_says_why_after_waiting_for_rank_0(monkeypatch, capsys):
    from pystronghold.cli import main
    from pystronghold.train import command

    monkeypatch.setattr(command, "RANK_0_REPORT_WAIT_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    assert main(["train", *ARGS, "--data", "/nonexistent/text"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pystronghold train: error: rank 1: ") and "/nonexistent/text" in err[0]


def test_single_process_with_tp_says_how_to_launch():
    p = run_train(1, "--tp", "2")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "pystronghold train: error: --tp 2 x --dp 1 needs 2 processes; launch with torchrun "
        "--nproc-per-node 2 -m pystronghold train ..."]


def test_checkpoints_accepted_with_tp_and_dp(monkeypatch):
    from pystronghold.train import resolve
    from pystronghold.train.config import CheckpointOptions, ParallelOptions, TrainConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    run = resolve(TrainConfig(parallel=ParallelOptions(tp=2), checkpoint=CheckpointOptions(checkpoint_dir="ck")))
    assert run.model.tp_size == 2 and run.config.parallel.dp_size == 1
    run = resolve(TrainConfig(parallel=ParallelOptions(dp=2), checkpoint=CheckpointOptions(checkpoint_dir="ck")))
    assert run.config.parallel.dp_size == 2 and run.model.tp_size == 1


def test_dp_checkpoint_written_by_rank_0_resumed_by_every_rank(reference, checkpointing, tmp_path):
    import shutil

    ck = checkpointing.copy_to(tmp_path, 2, "--dp", "2")
    assert listing(ck) == ["step-00000002", "step-00000003"]  # one writer: no clashes
    shutil.rmtree(os.path.join(ck, "step-00000003"))
    p = run_train(2, "--dp", "2", "--checkpoint-dir", ck, "--resume")
    assert_logs_reference(p, reference, from_step=3)


def test_tp_checkpoint_resumed_by_one_process(reference, checkpointing, tmp_path):
    """Every rank of a --tp 2 run joins the save (split tensors gathered), rank 0 writes whole
    parameters, and a single process resumes from them."""
    import shutil

    ck = checkpointing.copy_to(tmp_path, 2, "--tp", "2")
    assert listing(ck) == ["step-00000002", "step-00000003"]
    shutil.rmtree(os.path.join(ck, "step-00000003"))
    p = run_train(1, "--checkpoint-dir", ck, "--resume")
    assert_logs_reference(p, reference, from_step=3)


# NOTE: rank 1 leaves at the start of a step, as if killed, before that step's collectives; rank 0
# then meets a closed connection in its first one (no launcher: nothing else ends rank 0).
DYING_RANK = """
import os, sys
import pystronghold.train.loop as loop
step = loop.Trainer.train_step

def train_step(self):
    if self.rank == 1 and self.step + 1 == 2:
        os._exit(9)
    return step(self)

loop.Trainer.train_step = train_step
sys.argv = ["pystronghold", *sys.argv[1:]]
from pystronghold.cli import run
run()
"""


def test_the_rank_that_survives_a_killed_peer_says_so_in_one_line():
    """The two processes of a --dp 2 run as torchrun starts them; one dies in step 2: the other
    exits 1 with one line naming its failed collective and the step (it printed a traceback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2")
    cmd = [sys.executable, "-c", DYING_RANK, "train", *ARGS, "--dp", "2", "--steps", "4"]
    ranks = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        err = ranks[0].communicate(timeout=TIMEOUT_S)[1]
        assert ranks[1].wait(timeout=TIMEOUT_S) == 9
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert ranks[0].returncode == 1, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert err.startswith("pystronghold train: error: rank 0: a collective with the other processes failed in "
                          "step 2: "), err
    assert err.strip().endswith("(another process of the run stopped or was killed: see its output)"), err
