"""``torchrun -m pystronghold train --pp P``: pipeline stages launched by torch.distributed.run.

A --pp 2 run (2 micro-batches per step) logs the losses of the single-process run on the same
global batches (fp32; the metrics lines print 4 decimals and must be equal: |difference| <= 1e-4,
while one step moves the loss by ~0.1). The exact equivalence at 1e-6 is in
test_parallel_pipeline.py; this file checks the CLI's plumbing: the split printed at start, the
stage groups, rank-0 output, and bad layouts failing on every rank with one line from rank 0.
"""

from __future__ import annotations

import pytest
from torchrun_cli import CheckpointingRuns, assert_logs_reference, reference_losses, run_train
from train_helpers import listing


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


@pytest.fixture(scope="module")
def checkpointing(tmp_path_factory):
    """Each layout launched once: its log and the checkpoints it writes are checked apart."""
    return CheckpointingRuns(tmp_path_factory)


PP2 = ("--pp", "2", "--micro-batches", "2")


def test_pp2_logs_the_single_process_losses_and_prints_the_split(reference, checkpointing):
    p, _ = checkpointing(2, *PP2)
    assert_logs_reference(p, reference)
    assert p.stdout.count("trained steps 1..3") == 1
    # tiny: 4 equal blocks; the LM head (V=256) outweighs the embedding, so no block moves
    assert p.stdout.count("pipeline split over 2 stages: stage 0: head + blocks 0-1 (") == 1
    assert "stage 1: blocks 2-3 + LM head" in p.stdout


INTERLEAVED = ("--pp", "2", "--micro-batches", "2", "--pp-schedule", "interleaved", "--pp-chunks", "2")


def test_pp2_interleaved_logs_the_single_process_losses_and_prints_the_chunks(reference, checkpointing):
    """Two model chunks per rank (tiny: 4 chunks of one block; rank 0 holds blocks 0 and 2)."""
    p, _ = checkpointing(2, *INTERLEAVED)
    assert_logs_reference(p, reference)
    assert p.stdout.count("pipeline split over 2 stages x 2 chunks: rank 0 chunk 0: head + blocks 0-0 (") == 1
    assert "rank 1 chunk 0: blocks 1-1 (" in p.stdout and "rank 0 chunk 1: blocks 2-2 (" in p.stdout
    assert "rank 1 chunk 1: blocks 3-3 + LM head" in p.stdout


def test_pp_misconfiguration_fails_on_every_rank_with_one_message():
    p = run_train(3, "--pp", "2")
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if line.startswith("pystronghold train: error:")]
    assert len(ours) == 1 and "--pp 2 x --tp 1 x 1 data-parallel replicas = 2 processes, but there are 3" in ours[0]
    assert "exitcode: 2" in p.stderr


@pytest.mark.parametrize("extra, world, message", [
    (dict(pp=6), 6, "ParallelOptions.pp=6 stages are more than the model's 4 blocks"),
    (dict(pp=2, micro_batches=1), 2, "ParallelOptions.micro_batches=1 must be at least pp=2 stages"),
    (dict(pp=2, micro_batches=8), 2, "--batch 4 must be divisible by 1 data-parallel replicas x 8 micro-batches"),
    (dict(pp=2), 1, "launch with torchrun --nproc-per-node 2"),
    (dict(pp=2, micro_batches=3, pp_schedule="interleaved", pp_chunks=2), 2,
     "ParallelOptions.micro_batches=3 must be a multiple of pp=2 stages for the interleaved schedule"),
    (dict(pp=2, pp_schedule="interleaved", pp_chunks=3), 2,
     "ParallelOptions.pp=2 stages x pp_chunks=3 = 6 model chunks are more than the model's 4 blocks"),
    (dict(pp=2, pp_schedule="interleaved"), 2, "ParallelOptions.pp_chunks=1 must be >= 2 with pp_schedule='interleaved'"),
    (dict(pp=2, pp_chunks=2), 2, "ParallelOptions.pp_chunks=2 needs pp_schedule='interleaved'"),
], ids=["more-stages-than-blocks", "too-few-micro-batches", "batch-not-divisible", "one-process",
        "interleaved-micro-batches-not-a-multiple", "more-chunks-than-blocks", "interleaved-one-chunk",
        "chunks-without-interleaved"])
def test_pp_layouts_checked_before_any_collective(monkeypatch, extra, world, message):
    """TrainConfig's and resolve's checks: local arithmetic that every rank runs alike before init_parallel."""
    from pystronghold.options import ConfigError
    from pystronghold.train import resolve
    from pystronghold.train.config import DataOptions, ModelOptions, ParallelOptions, TrainConfig

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        resolve(TrainConfig(model=ModelOptions(model="tiny"), data=DataOptions(batch=4),
                            parallel=ParallelOptions(**extra)))


def test_resident_blocks_must_fit_every_stage(monkeypatch):
    """Each stage keeps --resident-blocks of its own blocks on the device: a stage with fewer
    blocks would fail alone in wrap, after the others entered a collective (a hang)."""
    from pystronghold.options import ConfigError
    from pystronghold.runtime.config import RuntimeConfig
    from pystronghold.train import resolve
    from pystronghold.train.config import DataOptions, ModelOptions, ParallelOptions, TrainConfig

    monkeypatch.setenv("WORLD_SIZE", "2")

    def config(resident):
        return resolve(TrainConfig(model=ModelOptions(model="tiny"), data=DataOptions(batch=4),
                                   runtime=RuntimeConfig(resident_blocks=resident), parallel=ParallelOptions(pp=2)))

    assert config(2).runtime.resident_blocks == 2  # tiny: 4 blocks, 2 per stage
    with pytest.raises(ConfigError, match=r"RuntimeConfig.resident_blocks=3 is more than the 2 blocks of "
                                          r"pipeline stage 0 \(--pp 2 splits the blocks \[2, 2\]\)"):
        config(3)


@pytest.mark.parametrize("writer, reader", [(PP2, ()), ((), ("--pp", "2")), (INTERLEAVED, ()), (PP2, INTERLEAVED)],
                         ids=["pp2-resumed-by-one-process", "one-process-resumed-by-pp2",
                              "interleaved-resumed-by-one-process", "pp2-resumed-by-interleaved"])
def test_checkpoints_cross_resume_between_pipeline_and_one_process(reference, checkpointing, tmp_path, writer,
                                                                   reader):
    """The stages send their blocks (global names) to rank 0, which writes the usual format; each
    stage reads back only its own blocks. Step 3 of the resumed run is step 3 of the reference."""
    import os
    import shutil

    ck = checkpointing.copy_to(tmp_path, 2 if writer else 1, *writer)
    assert listing(ck) == ["step-00000002", "step-00000003"]
    shutil.rmtree(os.path.join(ck, "step-00000003"))
    p = run_train(2 if reader else 1, *reader, "--checkpoint-dir", ck, "--resume")
    assert_logs_reference(p, reference, from_step=3)
