"""The planner's pipeline model: bubble (p-1)/m (checked against a measured run's idle time),
in-flight activations, point-to-point bytes, and ``pystronghold plan --pp``."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

from pystronghold.cli import main
from pystronghold.models import GPTConfig
from pystronghold.planner import Hardware, gpu_preset, make_plan
from pystronghold.planner.cost import Workload
from pystronghold.planner.hardware import GiB
from pystronghold.planner.pipeline import bubble_fraction, in_flight_micro_batches, plan_pipeline


def test_bubble_fraction_formulas():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)  # 1F1B / GPipe: (p-1)/m
    assert bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 16)  # interleaved: (1/v)(p-1)/m
    assert bubble_fraction(1, 3) == 0.0
    with pytest.raises(ValueError, match="must be >= 1"):
        bubble_fraction(2, 0)


def test_plan_pipeline_in_flight_activations_and_p2p_bytes():
    cfg = GPTConfig(vocab_size=256, seq_len=64, layers=8, hidden=64, heads=4)
    work = Workload(batch=2, precision="fp32")
    plan = plan_pipeline(cfg, work, 4, 8)
    assert plan.in_flight == [4, 3, 2, 1]  # 1F1B: p - s warm-up forwards
    assert [len(r) for r in plan.split] == [2, 2, 2, 2]
    assert plan.p2p_bytes == 2 * 64 * 64 * 4  # B*T*C*s
    assert plan.activation_bytes == [n * 2 * plan.p2p_bytes for n in (4, 3, 2, 1)]  # block inputs (recompute)
    assert sum(plan.stage_flop_share) == pytest.approx(1.0)
    assert plan_pipeline(cfg, work, 4, 8, "gpipe").in_flight == [8] * 4
    assert in_flight_micro_batches("1f1b", 0, 2, 1) == 1
    with pytest.raises(ValueError, match="more than the model's 8 blocks"):
        plan_pipeline(cfg, work, 9, 9)


class _ScheduleStage:
    """What torch's multi-stage schedules read of a stage to build their per-rank action lists."""

    def __init__(self, index: int, stages: int, chunks: int, rank: int) -> None:
        self.group_size, self.group_rank, self.stage_index = stages, rank, index
        self.num_stages = stages * chunks
        self.is_first, self.is_last = index == 0, index == stages * chunks - 1
        self.stage_index_to_group_rank = {i: i % stages for i in range(stages * chunks)}


@pytest.mark.parametrize("stages, chunks", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
def test_interleaved_in_flight_is_the_peak_of_torchs_schedule(stages, chunks):
    """The planner's chunk forwards in flight on each rank equal the peak of forwards done and
    backwards not in torch's own ScheduleInterleaved1F1B action list (which the runtime's step plan
    follows, read by ``rank_passes``): each chunk runs m forwards and m backwards."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from pystronghold.planner.pipeline import rank_passes

    for m in (stages, 2 * stages, 3 * stages):
        for rank in range(stages):
            schedule = ScheduleInterleaved1F1B(
                [_ScheduleStage(rank + c * stages, stages, chunks, rank) for c in range(chunks)], m)
            passes = rank_passes(schedule.pipeline_order[rank], stages)
            assert sorted(passes) == sorted((c, k) for c in range(chunks) for k in ("fwd", "bwd") for _ in range(m))
            held, peak = 0, 0
            for _, kind in passes:
                held += 1 if kind == "fwd" else -1
                peak = max(peak, held)
            assert in_flight_micro_batches("interleaved", rank, stages, m, chunks) == peak, (m, rank)


def test_plan_pipeline_interleaved_splits_p_times_v_chunks():
    cfg = GPTConfig(vocab_size=256, seq_len=64, layers=8, hidden=64, heads=4)
    work = Workload(batch=2, precision="fp32")
    plan = plan_pipeline(cfg, work, 2, 4, "interleaved", chunks=2)
    assert plan.bubble == pytest.approx(1 / 8)  # (1/v)(p-1)/m
    assert len(plan.split) == 4 and plan.stage_split(0) == [plan.split[0], plan.split[2]]
    assert sum(plan.stage_blocks(s) for s in range(2)) == 8
    assert sum(plan.stage_flop_share) == pytest.approx(1.0)
    assert plan.in_flight == [5, 3]  # (v-1)p + 2(p-1-s) + 1
    per_block = plan.p2p_bytes  # recompute: a block input per block
    assert plan.activation_bytes == [n * max(len(r) for r in plan.stage_split(s)) * per_block
                                     for s, n in enumerate(plan.in_flight)]
    assert plan.stage_in_flight(0) == -(-plan.activation_bytes[0] // (plan.stage_blocks(0) * per_block))
    with pytest.raises(ValueError, match="micro_batches=3 must be a multiple of pp=2 stages"):
        plan_pipeline(cfg, work, 2, 3, "interleaved", chunks=2)
    with pytest.raises(ValueError, match="pp=4 stages x pp_chunks=3 = 12 model chunks are more than the model's 8"):
        plan_pipeline(cfg, work, 4, 4, "interleaved", chunks=3)
    with pytest.raises(ValueError, match="pp_chunks=1 must be >= 2 with pp_schedule='interleaved'"):
        plan_pipeline(cfg, work, 2, 4, "interleaved")
    with pytest.raises(ValueError, match="pp_chunks=2 needs pp_schedule='interleaved'"):
        plan_pipeline(cfg, work, 2, 4, "1f1b", chunks=2)


def test_cli_plan_prints_the_pipeline(capsys):
    args = ["plan", "--gpu", "h100-80gb", "--host-memory", "512", "--model", "gpt3-1.3b", "--pp", "4",
            "--micro-batches", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "pipeline  4 stages, 8 micro-batches, 1f1b: bubble 37.5% of compute" in out
    assert "  stage 3: blocks" in out and "+ LM head" in out
    assert main(args + ["--json"]) == 0
    pipe = json.loads(capsys.readouterr().out)["pipeline"]
    assert pipe["bubble_fraction"] == pytest.approx(3 / 8) and pipe["in_flight"] == [4, 3, 2, 1]
    assert main(["plan", "--gpu", "h100-80gb", "--host-memory", "512", "--model", "tiny", "--pp", "8"]) == 2
    assert "--pp 8 stages are more than the model's 4 blocks" in capsys.readouterr().err
    assert main(args + ["--pp-schedule", "interleaved", "--pp-chunks", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline  4 stages x 2 chunks, 8 micro-batches, interleaved: bubble 18.8% of compute" in out
    assert "  stage 0: head + blocks 0-" in out and "11 chunk forwards in flight" in out
    assert main(["plan", "--gpu", "h100-80gb", "--host-memory", "512", "--model", "tiny", "--pp-chunks", "2"]) == 2
    assert "--pp-chunks 2 needs --pp-schedule interleaved" in capsys.readouterr().err
    assert main(args + ["--pp-schedule", "interleaved"]) == 2
    assert "--pp-chunks 1 must be >= 2 with --pp-schedule interleaved" in capsys.readouterr().err


def test_plan_pp_counts_the_in_flight_activations_in_device_memory(capsys):
    """The device peak of a pipeline plan holds the saved activations of every micro-batch in
    flight (1F1B: p on stage 0), not one micro-batch's: the planner must not pick a window that
    only fits one micro-batch's activations."""
    # every block streamed (K = 0): each micro-batch then keeps only its block inputs
    base = ["plan", "--gpu", "h100-80gb", "--host-memory", "512", "--model", "gpt3-1.3b", "--json",
            "--resident-blocks", "0"]
    assert main(base + ["--pp", "4", "--micro-batches", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    stage_blocks = max(b - a for a, b in out["pipeline"]["split"])
    assert out["pipeline"]["in_flight"][0] == 4
    # the same stage alone (one micro-batch in flight), and the difference: 3 more micro-batches'
    # block inputs (recompute keeps only those), B*T*C*s bytes each per block
    assert main(base + ["--layers", str(stage_blocks)]) == 0
    alone = json.loads(capsys.readouterr().out)
    held = out["device"]["activation_bytes"] - alone["device"]["activation_bytes"]
    assert held == 3 * stage_blocks * out["pipeline"]["p2p_bytes_per_micro_batch"]
    cfg = GPTConfig(vocab_size=256, seq_len=64, layers=8, hidden=64, heads=4)
    hw = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=512 * GiB)
    with pytest.raises(ValueError, match="in_flight must be a positive int"):
        make_plan(cfg, Workload(batch=2), hw, in_flight=0)


# ---- the bubble of a real run

PASS_S = 0.1  # one block's forward (and its recompute in backward): a sleep, so the load of the machine hardly matters


class _SleepBlock(nn.Module):
    """A block whose compute is a fixed sleep; records the time it spends."""

    busy_s = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(PASS_S)
        _SleepBlock.busy_s += time.perf_counter() - t0
        return x + self.lin(x)


def _measured_bubble(rank: int, world: int, results) -> None:
    import pystronghold as ph
    from pystronghold.parallel import init_parallel
    from pystronghold.pipelining import Pipeline, build_stage

    groups = init_parallel(1, pp=2, timeout_s=30)
    for m, chunks in ((4, 1), (8, 1), (4, 2)):
        torch.manual_seed(0)
        # chunk c of rank r: virtual stage r + 2c, one sleeping block; token ids (B, T) -> (B, T, 4)
        stages = [build_stage(nn.Embedding(10, 4) if groups.pp_rank + c == 0 else None, [_SleepBlock()], None,
                              first_block=groups.pp_rank + 2 * c) for c in range(chunks)]
        pipe = Pipeline(stages, groups, loss_fn=lambda out, y: (out - y).square().mean(), micro_batches=m,
                        hidden=4, output_size=4, window=1, optimizer=ph.AdamW(lr=1e-3),
                        schedule="interleaved" if chunks > 1 else "1f1b")
        x, y = torch.randint(0, 10, (m, 3)), torch.randn(m, 3, 4)
        try:
            pipe.step(x, y)  # the first step exchanges shapes
            dist.barrier()
            _SleepBlock.busy_s = 0.0
            t0 = time.perf_counter()
            pipe.step(x, y)
            wall = time.perf_counter() - t0
        finally:
            pipe.close()
        idle = (wall - _SleepBlock.busy_s) / _SleepBlock.busy_s
        if rank == 0:
            results[m, chunks] = idle


def test_bubble_formula_matches_the_idle_time_of_a_run():
    """Two stages of one block whose forward and recompute sleep PASS_S: each stage computes for
    2*m*PASS_S and idles for the (p-1) = 1 slot of fill and drain, so idle / compute = (p-1)/m;
    interleaved with two one-block chunks per rank, the slot is half a stage: (1/v)(p-1)/m.
    Tolerance 0.08 absolute: what the runtime itself adds per pass (a few ms against 100 ms)."""
    import torch.multiprocessing as mp

    results = mp.get_context("forkserver").Manager().dict()
    run_ranks(_measured_bubble, 2, results, timeout_s=150)
    for m, chunks in ((4, 1), (8, 1), (4, 2)):
        assert results[m, chunks] == pytest.approx(bubble_fraction(2, m, chunks), abs=0.08), dict(results)
    assert results[4, 1] > results[8, 1]
    assert results[4, 1] > results[4, 2]  # the same micro-batches, half the bubble
