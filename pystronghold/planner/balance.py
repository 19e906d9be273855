"""Hardware-aware balancing, Whale (Jia et al., USENIX ATC'22) section 3.3.

- replicate (data parallelism): ``balance_batch`` gives device i a local batch b_i proportional to
  its throughput, capped by its memory, minimising max_i b_i / s_i; ``dp_loss_weight`` keeps the
  global gradient the equal-split one.
- stage (pipeline): ``balance_stages`` splits blocks into contiguous stages minimising the slowest
  stage's time within each device's memory (exact dynamic programming, O(S n^2)).
- split (tensor parallelism): not balanced (TP shards are even); ``split_throughput`` is the
  slowest device's.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

__all__ = ["proportional_batch", "balance_batch", "balance_batch_times", "dp_loss_weight", "batch_slices",
           "StageSplit", "balance_stages", "balance_stage_counts", "contiguous_split", "split_throughput",
           "stage_ranges"]


def _positive_list(name: str, values) -> list[float]:
    values = list(values)
    if not values:
        raise ValueError(f"{name} must not be empty")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be positive numbers, got {v!r}")
    return [float(v) for v in values]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def proportional_batch(global_batch: int, speeds: list[float]) -> list[float]:
    """Whale's replicate ratio: b_i = B * s_i / sum(s), fractional samples (no memory caps)."""
    speeds = _positive_list("speeds", speeds)
    total = sum(speeds)
    return [global_batch * s / total for s in speeds]


def balance_batch(global_batch: int, speeds: list[float], capacities: list[int] | None = None) -> list[int]:
    """Whole-sample local batches summing to ``global_batch`` that minimise max_i b_i / s_i.

    ``speeds``: samples/s of each device (any consistent unit). ``capacities``: the most samples each
    device's memory holds (None: unbounded). Every device gets at least one sample (a DP rank
    with none would have no loss to back-propagate). ValueError when the capacities cannot hold the
    batch or the batch is smaller than the number of devices.
    """
    _positive_int("global_batch", global_batch)
    speeds = _positive_list("speeds", speeds)
    n = len(speeds)
    caps = [global_batch] * n if capacities is None else [_positive_int("capacities[i]", c) for c in capacities]
    if len(caps) != n:
        raise ValueError(f"capacities has {len(caps)} entries for {n} devices")
    if global_batch < n:
        raise ValueError(f"global_batch={global_batch} is smaller than the {n} devices (each needs a sample)")
    if sum(min(c, global_batch) for c in caps) < global_batch:
        raise ValueError(f"global_batch={global_batch} does not fit: the devices' memory holds "
                         f"{sum(caps)} samples in all")
    return balance_batch_times(global_batch, [lambda b, s=s: b / s for s in speeds], caps)


def balance_batch_times(global_batch: int, times, capacities: list[int] | None = None) -> list[int]:
    """Whole-sample batches summing to ``global_batch`` that minimise max_i times[i](b_i), for
    per-device time functions that do not decrease with the batch (a cost model's step time, with
    its fixed parts: optimizer, transfers); ``math.inf`` marks a batch that does not fit.

    Samples are handed out one at a time to the device whose time after taking it is least: for
    separable non-decreasing times this greedy reaches the least maximum (an exchange argument:
    any optimum can be reordered into the greedy's sequence of increments). Every device gets at
    least one sample. ValueError when the batch does not fit.
    """
    _positive_int("global_batch", global_batch)
    times = list(times)
    n = len(times)
    if n == 0:
        raise ValueError("times must not be empty")
    caps = [global_batch] * n if capacities is None else list(capacities)
    if global_batch < n:
        raise ValueError(f"global_batch={global_batch} is smaller than the {n} devices (each needs a sample)")
    if any(math.isinf(times[i](1)) for i in range(n)):
        raise ValueError("global_batch does not fit: a device cannot hold even one sample")
    sizes = [1] * n
    heap = []
    for i in range(n):
        if sizes[i] < caps[i] and math.isfinite(t := times[i](2)):
            heap.append((t, i))
    heapq.heapify(heap)
    for _ in range(global_batch - n):
        if not heap:
            raise ValueError(f"global_batch={global_batch} does not fit: the devices hold {sum(sizes)} samples")
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < caps[i] and math.isfinite(t := times[i](sizes[i] + 1)):
            heapq.heappush(heap, (t, i))
    return sizes


def dp_loss_weight(local_batch: int, global_batch: int, dp_size: int) -> float:
    """The factor a DP rank multiplies its mean loss by so that the DP *average* of gradients is
    the gradient of the mean loss over the global batch: local_batch * dp_size / global_batch
    (1 for an even split)."""
    for name, value in (("local_batch", local_batch), ("global_batch", global_batch), ("dp_size", dp_size)):
        _positive_int(name, value)
    if local_batch > global_batch:
        raise ValueError(f"local_batch={local_batch} exceeds global_batch={global_batch}")
    return local_batch * dp_size / global_batch


def batch_slices(sizes: list[int]) -> list[slice]:
    """The slice of the global batch each rank takes, in rank order."""
    out, start = [], 0
    for s in sizes:
        _positive_int("sizes[i]", s)
        out.append(slice(start, start + s))
        start += s
    return out


def split_throughput(speeds: list[float]) -> float:
    """Throughput of one TP group: even shards, so every member waits for the slowest,
    len * min(speeds)."""
    speeds = _positive_list("speeds", speeds)
    return len(speeds) * min(speeds)


@dataclass(frozen=True, slots=True)
class StageSplit:
    """Blocks per pipeline stage and the device each stage runs on."""

    devices: tuple[int, ...]
    """Device index (into the caller's list) of stage 0, 1, ...: largest memory first."""
    blocks: tuple[int, ...]
    """Blocks of each stage, in order (contiguous, every stage at least one)."""
    stage_s: tuple[float, ...]
    """Compute time of each stage per micro-batch, seconds (FLOPs without device speeds)."""

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time: what a steady pipeline advances at."""
        return max(self.stage_s)

    @property
    def ranges(self) -> list[range]:
        """The block indices of each stage, as the pipeline runtime takes them (``split=``)."""
        starts = [sum(self.blocks[:s]) for s in range(len(self.blocks))]
        return [range(a, a + k) for a, k in zip(starts, self.blocks)]


def balance_stages(block_flops: list[float], device_flops: list[float] | None = None,
                   device_memory: list[float] | None = None, block_bytes: list[float] | None = None,
                   block_activation_bytes: list[float] | None = None, *, stages: int | None = None,
                   first_stage_flops: float = 0.0, last_stage_flops: float = 0.0) -> StageSplit:
    """Contiguous blocks -> stages minimising the slowest stage, within each device's memory.

    ``block_flops``: FLOPs of each block per micro-batch (or any cost unit); ``device_flops``:
    FLOP/s of each device (one stage per device; ``stages`` defaults to their count; None: ``stages``
    identical devices, stage times in FLOPs); ``device_memory``: bytes each may use (None:
    unbounded). A stage s of S holding blocks K needs sum(block_bytes[K]) + (S - s) *
    sum(block_activation_bytes[K]) bytes (1F1B keeps S - s micro-batches in flight at stage s).
    ``first_stage_flops`` / ``last_stage_flops``: work only the first stage (the embeddings) or the
    last (the final norm, LM head and loss) does. ValueError when no split fits.
    """
    flops = _positive_list("block_flops", block_flops)
    n = len(flops)
    if device_flops is None:
        if stages is None:
            raise ValueError("balance_stages: give device_flops or stages")
        dev_flops = [1.0] * _positive_int("stages", stages)
    else:
        dev_flops = _positive_list("device_flops", device_flops)
    dev_mem = [math.inf] * len(dev_flops) if device_memory is None else _positive_list("device_memory", device_memory)
    if len(dev_mem) != len(dev_flops):
        raise ValueError(f"device_memory has {len(dev_mem)} entries for {len(dev_flops)} devices")
    S = len(dev_flops) if stages is None else _positive_int("stages", stages)
    if S > len(dev_flops):
        raise ValueError(f"stages={S} needs at least {S} devices, got {len(dev_flops)}")
    for name, value in (("first_stage_flops", first_stage_flops), ("last_stage_flops", last_stage_flops)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    static = [0.0] * n if block_bytes is None else [float(b) for b in block_bytes]
    acts = [0.0] * n if block_activation_bytes is None else [float(b) for b in block_activation_bytes]
    if len(static) != n or len(acts) != n:
        raise ValueError("block_bytes and block_activation_bytes need one entry per block")
    # largest memory first; among equals the faster device first
    order = sorted(range(len(dev_flops)), key=lambda d: (-dev_mem[d], -dev_flops[d], d))[:S]
    pf, pb, pa = [0.0], [0.0], [0.0]
    for f, b, a in zip(flops, static, acts):
        pf.append(pf[-1] + f)
        pb.append(pb[-1] + b)
        pa.append(pa[-1] + a)

    def cost(s: int, i: int, j: int) -> float:  # blocks i..j-1 on stage s; inf when they do not fit
        d = order[s]
        need = pb[j] - pb[i] + (S - s) * (pa[j] - pa[i])
        work = pf[j] - pf[i] + (first_stage_flops if s == 0 else 0.0) + (last_stage_flops if s == S - 1 else 0.0)
        return math.inf if need > dev_mem[d] else work / dev_flops[d]

    ranges = contiguous_split(n, S, cost)
    return StageSplit(devices=tuple(order), blocks=tuple(len(r) for r in ranges),
                      stage_s=tuple(cost(s, r.start, r.stop) for s, r in enumerate(ranges)))



def stage_ranges(block_costs: list[float], stages: int, *, head_cost: float = 0.0,
                 tail_cost: float = 0.0) -> list[range]:
    """The block ranges of ``stages`` pipeline stages on identical devices (``balance_stages`` with
    ``stages=``): contiguous, non-empty, the largest stage cost smallest, stage 0 also paying
    ``head_cost`` and the last ``tail_cost`` (any unit, e.g. FLOPs per token). What the pipeline
    runtime (``pipelining.gpt``) and its planner split by."""
    return balance_stages(list(block_costs), stages=stages, first_stage_flops=head_cost,
                          last_stage_flops=tail_cost).ranges

def balance_stage_counts(n_blocks: int, stages: int, stage_time) -> tuple[int, ...]:
    """Blocks per stage (contiguous, each >= 1, summing to ``n_blocks``) minimising
    max_s stage_time(s, count_s), for identical blocks and any per-stage time (a cost model's,
    with its fixed parts; ``math.inf`` where the stage does not fit). Exact, O(stages * n^2)
    calls at most. ValueError when no split fits."""
    ranges = contiguous_split(n_blocks, stages, lambda s, i, j: stage_time(s, j - i))
    return tuple(len(r) for r in ranges)


def contiguous_split(n_blocks: int, stages: int, cost) -> list[range]:
    """Blocks ``0 .. n_blocks-1`` cut into ``stages`` contiguous non-empty ranges minimising the
    largest ``cost(s, i, j)`` (blocks i..j-1 on stage s, in any unit; ``math.inf`` where they do
    not fit). Exact dynamic programming, O(stages * n^2) calls; ties go to the earliest
    boundaries. ValueError when no split fits."""
    n, S = _positive_int("n_blocks", n_blocks), _positive_int("stages", stages)
    if S > n:
        raise ValueError(f"{S} stages need at least {S} blocks, got {n}")
    best = [[math.inf] * (n + 1) for _ in range(S + 1)]  # best[s][j]: blocks 0..j-1 on stages 0..s-1
    cut = [[0] * (n + 1) for _ in range(S + 1)]  # cut[s][j]: where stage s-1 starts in that split
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, n - (S - s) + 1):
            for i in range(s - 1, j):
                if math.isinf(best[s - 1][i]):
                    continue
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if math.isinf(best[S][n]):
        raise ValueError(f"no split of {n} blocks over {S} stages fits the devices' memory")
    ranges, j = [], n
    for s in range(S, 0, -1):
        ranges.append(range(cut[s][j], j))
        j = cut[s][j]
    return ranges[::-1]
