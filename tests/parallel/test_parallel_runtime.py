"""Data and tensor parallelism through the window runtime (W=2), on real gloo processes.

Every parallel run is compared with plain PyTorch training of the single-process model on the
whole batch (the concatenation of the DP ranks' slices), to the tolerance stated in
tests/parallel_training.py (rtol 1e-5; atol 1e-5 on parameters).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.multiprocessing as mp
from _dist import run_ranks
from parallel_training import (CFG, CLIP, HYPER, assert_matches_single_process, assert_replicas_identical,
                               full_params, parallel_data, single_process_run, train_rank)

import pystronghold as ph
from pystronghold.models import GPT
from pystronghold.parallel import init_parallel

# ---- DP = 2


def _dp2(rank: int, world: int) -> None:
    groups = init_parallel(tp_size=1, timeout_s=30)
    assert groups.dp_size == 2
    # accumulation (2 micro-batches of 2 sequences per rank): the average runs once, after the last
    data = parallel_data(steps=3, micro=2, batch=4)
    got = train_rank(GPT(CFG, seed=7), data, groups)
    assert_matches_single_process(got, single_process_run(data), clipped=False)
    assert_replicas_identical(got[2], groups.dp_group)
    # global-norm clipping (forward overlap): the norm of the averaged gradient, clipped alike
    data = parallel_data(steps=4, micro=1, batch=4)
    got = train_rank(GPT(CFG, seed=7), data, groups, clip_grad_norm=CLIP)
    assert_matches_single_process(got, single_process_run(data, clip=CLIP), clipped=True)
    assert_replicas_identical(got[2], groups.dp_group)
    # fp16: an overflow on rank 1 only makes both ranks skip the same step
    model = GPT(CFG, seed=7)
    engine = ph.wrap(model, blocks=model.blocks, window=2, parallel=groups, precision="fp16",
                     optimizer=ph.AdamW(**HYPER))
    try:
        for step, tokens in enumerate(parallel_data(steps=3, micro=1, batch=2)[:, 0]):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss * (math.inf if (rank, step) == (1, 1) else 1.0))
            engine.step()
            engine.zero_grad()
        assert (engine.stats()["steps"], engine.stats()["skipped_steps"]) == (2, 1)
        assert_replicas_identical(engine.master_parameters(), groups.dp_group)
    finally:
        engine.close()


def test_dp2_window_equals_single_process_on_the_whole_batch():
    run_ranks(_dp2, 2, timeout_s=120)


# ---- TP = 2, and TP = 2 x DP = 2


def _tp(rank: int, world: int, steps: int) -> None:
    groups = init_parallel(tp_size=2, heads=CFG.heads, timeout_s=30)
    model = GPT(dataclasses.replace(CFG, tp_size=2), seed=7, tp_group=groups.tp_group)
    # clipping: the norm sums the TP shards and counts replicated parameters (norms, biases) once
    data = parallel_data(steps=steps, micro=1, batch=2 * groups.dp_size)
    losses, norms, params = train_rank(model, data, groups, clip_grad_norm=CLIP)
    assert_matches_single_process((losses, norms, full_params(model, params, groups.tp_group)), single_process_run(data, clip=CLIP),
                    clipped=True)
    if groups.dp_size > 1:
        assert_replicas_identical(params, groups.dp_group)


def test_tp2_window_equals_single_process():
    run_ranks(_tp, 2, 4, timeout_s=120)


def test_tp2_dp2_four_processes_equal_single_process():
    run_ranks(_tp, 4, 2, timeout_s=150)


# ---- failures


def _rank_raises_mid_training(rank: int, world: int) -> None:
    groups = init_parallel(tp_size=1, timeout_s=30)
    model = GPT(CFG, seed=7)
    engine = ph.wrap(model, blocks=model.blocks, window=2, parallel=groups)
    tokens = parallel_data(steps=1, micro=1, batch=2)[0, 0]
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    if rank == 1:
        raise RuntimeError("rank 1 fails before its backward")
    engine.backward(loss)  # rank 0 waits in the first block's gradient all_reduce


def test_a_rank_that_raises_in_training_is_reported_and_the_others_stopped():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails before its backward"):
        run_ranks(_rank_raises_mid_training, 2, timeout_s=60)
