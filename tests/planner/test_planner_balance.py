"""Whale 3.3 balancing: the batch split against Whale's ratio and brute force, the stage split
against brute force, memory caps, the loss weight, bad input."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pystronghold.planner.balance import (balance_batch, balance_stages, batch_slices, dp_loss_weight,
                                          proportional_batch, split_throughput, stage_ranges)


def _compositions(total: int, parts: int):
    """Every tuple of ``parts`` positive ints summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))


def test_batch_follows_whales_ratio_within_one_sample():
    speeds = [15.7] * 8 + [9.3] * 8  # V100 and P100 fp32 TFLOP/s
    sizes = balance_batch(512, speeds)
    assert sum(sizes) == 512
    for size, ideal in zip(sizes, proportional_batch(512, speeds)):
        assert abs(size - ideal) < 1
    assert sizes[0] > sizes[-1]


@pytest.mark.parametrize("seed", range(25))
def test_batch_split_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    batch = rng.randint(n, 12)
    speeds = [rng.uniform(0.5, 3.0) for _ in range(n)]
    caps = [rng.randint(1, batch) for _ in range(n)]
    if sum(caps) < batch:
        caps[0] = batch
    best = min(max(b / s for b, s in zip(comp, speeds)) for comp in _compositions(batch, n)
               if all(b <= c for b, c in zip(comp, caps)))
    sizes = balance_batch(batch, speeds, caps)
    assert sum(sizes) == batch and all(1 <= b <= c for b, c in zip(sizes, caps))
    assert max(b / s for b, s in zip(sizes, speeds)) == pytest.approx(best, rel=1e-12)


def test_memory_cap_moves_samples_to_the_other_devices():
    assert balance_batch(12, [4.0, 1.0, 1.0], [6, 100, 100]) == [6, 3, 3]


def test_loss_weight_and_slices():
    sizes = [5, 2, 1]
    weights = [dp_loss_weight(b, 8, 3) for b in sizes]
    assert sum(weights) == pytest.approx(3)  # the DP average of weights is 1: an unbiased mean
    assert dp_loss_weight(4, 8, 2) == 1.0
    assert batch_slices(sizes) == [slice(0, 5), slice(5, 7), slice(7, 8)]


@pytest.mark.parametrize("call, message", [
    (lambda: balance_batch(2, [1.0, 1.0, 1.0]), "smaller than the 3 devices"),
    (lambda: balance_batch(10, [1.0, 1.0], [3, 3]), "does not fit: the devices' memory holds 6"),
    (lambda: balance_batch(10, [1.0, -1.0]), "speeds must be positive numbers, got -1.0"),
    (lambda: balance_batch(10, [1.0], [3, 3]), "capacities has 2 entries for 1 devices"),
    (lambda: balance_batch(0, [1.0]), "global_batch must be a positive int, got 0"),
    (lambda: dp_loss_weight(9, 8, 2), "local_batch=9 exceeds global_batch=8"),
    (lambda: balance_stages([1.0], [1.0, 1.0], [1.0, 1.0]), "2 stages need at least 2 blocks"),
    (lambda: balance_stages([1.0] * 4, [1.0], [1.0], [2.0] * 4), "fits the devices' memory"),
], ids=["batch<devices", "caps", "negative-speed", "caps-length", "zero-batch", "weight", "blocks", "memory"])
def test_impossible_balances_are_refused_naming_the_cause(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _brute_stages(flops, dev_flops, dev_mem, static, acts):
    order = sorted(range(len(dev_flops)), key=lambda d: (-dev_mem[d], -dev_flops[d], d))
    S, best = len(order), math.inf
    for comp in _compositions(len(flops), S):
        start, worst = 0, 0.0
        for s, count in enumerate(comp):
            blocks = range(start, start + count)
            need = sum(static[b] for b in blocks) + (S - s) * sum(acts[b] for b in blocks)
            if need > dev_mem[order[s]]:
                worst = math.inf
                break
            worst = max(worst, sum(flops[b] for b in blocks) / dev_flops[order[s]])
            start += count
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(25))
def test_stage_split_is_the_brute_force_optimum(seed):
    rng = random.Random(100 + seed)
    n, S = rng.randint(3, 8), rng.randint(2, 3)
    flops = [rng.uniform(1, 4) for _ in range(n)]
    dev_flops = [rng.choice([9.3, 15.7]) for _ in range(S)]
    dev_mem = [rng.choice([16.0, 32.0]) for _ in range(S)]
    static = [rng.uniform(1, 3) for _ in range(n)]
    acts = [rng.uniform(0, 2) for _ in range(n)]
    best = _brute_stages(flops, dev_flops, dev_mem, static, acts)
    if math.isinf(best):
        with pytest.raises(ValueError, match="fits the devices' memory"):
            balance_stages(flops, dev_flops, dev_mem, static, acts)
        return
    split = balance_stages(flops, dev_flops, dev_mem, static, acts)
    assert sum(split.blocks) == n and min(split.blocks) >= 1
    assert split.bottleneck_s == pytest.approx(best, rel=1e-12)


def test_larger_memory_takes_the_earlier_stage_and_faster_devices_more_blocks():
    # device 0: P100 (16 GiB, 9.3), device 1: V100 (32 GiB, 15.7); 24 equal blocks
    split = balance_stages([1.0] * 24, [9.3, 15.7], [16.0, 32.0])
    assert split.devices == (1, 0)
    assert split.blocks == (15, 9)  # Whale's ratio 24 * 15.7 / 25 = 15.07
    # in-flight activations: stage 0 of 2 holds two micro-batches, so a tight memory moves blocks back
    tight = balance_stages([1.0] * 24, [9.3, 15.7], [16.0, 24.0], block_activation_bytes=[1.0] * 24)
    assert tight.blocks == (12, 12)


def test_split_throughput_is_limited_by_the_slowest_member():
    assert split_throughput([15.7, 9.3]) == pytest.approx(18.6)


@pytest.mark.parametrize("seed", range(15))
def test_cost_model_splits_are_brute_force_optima(seed):
    """The general forms the planner uses: non-linear, non-decreasing times with fixed parts and
    infeasible (inf) points, for the batch and for stage block counts."""
    from pystronghold.planner.balance import balance_batch_times, balance_stage_counts

    rng = random.Random(200 + seed)
    n = rng.randint(2, 3)
    batch = rng.randint(n, 10)
    fixed = [rng.uniform(0, 2) for _ in range(n)]
    rate = [rng.uniform(0.5, 2) for _ in range(n)]
    cap = [rng.randint(max(1, batch // n), batch) for _ in range(n)]
    times = [lambda b, i=i: math.inf if b > cap[i] else fixed[i] + (b / rate[i]) ** 1.3 for i in range(n)]
    best = min((max(t(b) for t, b in zip(times, comp)) for comp in _compositions(batch, n)), default=math.inf)
    if math.isinf(best):
        with pytest.raises(ValueError, match="does not fit"):
            balance_batch_times(batch, times)
    else:
        sizes = balance_batch_times(batch, times)
        assert sum(sizes) == batch and max(t(b) for t, b in zip(times, sizes)) == pytest.approx(best)
    blocks, S = rng.randint(3, 9), rng.randint(2, 3)
    over = [rng.uniform(0, 3) for _ in range(S)]
    speed = [rng.uniform(0.5, 2) for _ in range(S)]
    limit = [rng.randint(1, blocks) for _ in range(S)]

    def stage_time(s, k):
        return math.inf if k > limit[s] else over[s] + k / speed[s]

    best = min((max(stage_time(s, k) for s, k in enumerate(comp)) for comp in _compositions(blocks, S)),
               default=math.inf)
    if math.isinf(best):
        with pytest.raises(ValueError, match="fits the devices' memory"):
            balance_stage_counts(blocks, S, stage_time)
    else:
        counts = balance_stage_counts(blocks, S, stage_time)
        assert sum(counts) == blocks and max(stage_time(s, k) for s, k in enumerate(counts)) == pytest.approx(best)


def test_stage_split_of_identical_devices_counts_the_head_and_the_tail():
    """What the pipeline runtime asks (``gpt_stage``: no device list, the embeddings on the first
    stage and the LM head on the last): the brute-force optimum, contiguous ranges."""
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in (1, 2, 3, 4):
        split = balance_stages(costs, stages=stages, first_stage_flops=2.0, last_stage_flops=7.0)
        ranges = split.ranges
        assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]] and ranges[-1].stop == 8

        def worst(cuts):
            bounds = [0, *cuts, 8]
            loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            loads[0] += 2.0
            loads[-1] += 7.0
            return max(loads)

        best = min(worst(c) for c in itertools.combinations(range(1, 8), stages - 1))
        assert worst([r.start for r in ranges[1:]]) == best == split.bottleneck_s
    # the LM head's cost moves blocks off the last stage
    assert balance_stages([1.0] * 4, stages=2, last_stage_flops=2.0).blocks == (3, 1)
    with pytest.raises(ValueError, match="5 stages need at least 5 blocks, got 4"):
        balance_stages([1.0] * 4, stages=5)
    with pytest.raises(ValueError, match="give device_flops or stages"):
        balance_stages([1.0] * 4)


def test_stage_ranges_are_the_identical_device_split():
    """``stage_ranges``, what the pipeline runtime and its planner split by, is that split's ranges."""
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for stages in (1, 2, 3, 4):
        assert stage_ranges(costs, stages, head_cost=2.0, tail_cost=7.0) == balance_stages(
            costs, stages=stages, first_stage_flops=2.0, last_stage_flops=7.0).ranges
    assert [len(r) for r in stage_ranges([1.0] * 4, 2, tail_cost=2.0)] == [3, 1]
    with pytest.raises(ValueError, match="first_stage_flops must be a finite number >= 0"):
        balance_stages([1.0] * 4, stages=2, first_stage_flops=-1.0)
