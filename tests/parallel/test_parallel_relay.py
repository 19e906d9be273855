"""The relay schedule under data and tensor parallelism (gloo, real processes): the same losses,
norms and parameters as the default schedule on the same ranks and as one process on the whole
batch (tolerances: tests/test_parallel_runtime.py's)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import pystronghold as ph
from _dist import run_ranks
from pystronghold.models import GPT
from pystronghold.parallel import init_parallel
from parallel_training import (CFG, CLIP, HYPER, assert_matches_single_process, assert_replicas_identical, full_params,
                               parallel_data, single_process_run)


def _train(model: GPT, data: torch.Tensor, groups, schedule: str, **options):
    """This rank's run through engine.accumulate on its slice: (DP-mean losses, norms, masters)."""
    engine = ph.wrap(model, blocks=model.blocks, window=2, parallel=groups, strict=True, schedule=schedule,
                     optimizer=ph.AdamW(**HYPER), accumulation_steps=data.shape[1], **options)
    per_rank = data.shape[2] // groups.dp_size
    mine = data[:, :, groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
    losses, norms = [], []
    try:
        for step in mine:
            got = engine.accumulate(list(step), lambda t: engine(t[:, :-1], t[:, 1:]), mean=False)
            dist.all_reduce(got, group=groups.dp_group)
            losses += (got / groups.dp_size).tolist()
            engine.step()
            engine.zero_grad()
            norms.append(engine.grad_norm)
        params = engine.master_parameters()
    finally:
        engine.close()
    return losses, norms, params


def _relay_dp_tp(rank: int, world: int, tp: int) -> None:
    groups = init_parallel(tp_size=tp, heads=CFG.heads, timeout_s=30)
    cfg = dataclasses.replace(CFG, tp_size=tp)
    data = parallel_data(steps=3, micro=3, batch=2 * groups.dp_size)
    runs = {s: _train(GPT(cfg, seed=7, tp_group=groups.tp_group), data, groups, s, clip_grad_norm=CLIP)
            for s in ("default", "relay")}
    for s, (losses, norms, params) in runs.items():
        full = full_params(GPT(cfg, seed=7, tp_group=groups.tp_group), params, groups.tp_group)
        assert_matches_single_process((losses, norms, full), single_process_run(data, clip=CLIP), clipped=True)
        if groups.dp_size > 1:
            assert_replicas_identical(params, groups.dp_group)
    torch.testing.assert_close(torch.tensor(runs["relay"][0]), torch.tensor(runs["default"][0]), rtol=1e-6, atol=0)


def test_relay_dp2_equals_single_process():
    run_ranks(_relay_dp_tp, 2, 1, timeout_s=150)


def test_relay_tp2_equals_single_process():
    run_ranks(_relay_dp_tp, 2, 2, timeout_s=150)
