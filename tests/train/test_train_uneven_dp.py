"""``pystronghold train --dp 2 --dp-split 3,1``: uneven data parallelism (Whale's hardware-aware
replicate) from the CLI. Two gloo processes taking 3 and 1 of every 4 samples log the losses of one
process on the whole batch (metrics print 4 decimals: |difference| <= 1e-4, while one step moves
the loss by ~0.1). Without the loss weights (the plain DP average of the two ranks' means) step 1's
logged loss and every later step differ. The exact comparison at rtol 1e-6 is
tests/parallel/test_parallel_uneven.py's; this file checks the CLI's plumbing and its errors.
"""

from __future__ import annotations

import pytest
from torchrun_cli import assert_logs_reference, reference_losses, run_train


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


def test_uneven_split_logs_the_single_process_losses(reference):
    p = run_train(2, "--dp", "2", "--dp-split", "3,1")
    assert_logs_reference(p, reference)


@pytest.mark.parametrize("split, message", [
    ("3,1,1", "--dp-split 3,1,1 gives 3 replicas' samples, but there are --dp 2"),
    ("2,1", "--dp-split 2,1 sums to 3 samples, not --batch 4"),
    ("3,x", "--dp-split must be comma-separated sample counts like 3,1, got '3,x'"),
    ("4,0", "--dp-split must be positive sample counts, got (4, 0)"),
], ids=["replicas", "sum", "text", "zero"])
def test_bad_split_is_one_line(monkeypatch, split, message):
    import argparse

    from pystronghold.options import add_options, from_args
    from pystronghold.train.config import TrainConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = argparse.ArgumentParser()
    add_options(parser, TrainConfig)
    args = parser.parse_args(["--model", "tiny", "--batch", "4", "--dp", "2", "--dp-split", split])
    with pytest.raises(ValueError) as err:
        from_args(TrainConfig, args)
    assert str(err.value) == message
