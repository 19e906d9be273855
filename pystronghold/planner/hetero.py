"""Plans for clusters of unlike GPUs: TP x PP x DP sizes, stage splits, batch splits and each
piece's window W, from the planner's per-block cost model (Whale, Jia et al., ATC'22, 3.3).

A piece is one stage of one replica (``tp`` devices), timed by ``make_plan``. A replica's step is
(M + S - 1) times its slowest stage's micro-batch plus its slowest host update; the cluster's is
the slowest replica's plus the (non-overlapped) data-parallel all-reduce. Devices are placed as
Whale does (largest memory first); blocks go to stages by ``balance.balance_stage_counts`` and the
batch to replicas by ``balance.balance_batch_times``; the gain over even splits is reported.
Simplifications: every stage keeps head and tail on its device; host memory is shared evenly.
The model is a ``GPTConfig`` or a Hugging Face model's ``HFShape`` (``planner/hf_shape.py``; a TP
degree its family cannot split is left out of the search), trained as ``Workload.finetune`` says.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pystronghold.models.gpt import GPTConfig
from pystronghold.options import ConfigError
from pystronghold.planner.balance import balance_batch_times, balance_stage_counts
from pystronghold.planner.cluster import Cluster, load_cluster
from pystronghold.planner.cost import (Workload, block_params_per_rank, head_tail_params_per_rank,
                                       ring_allreduce_s)
from pystronghold.planner.hardware import Hardware, format_bytes
from pystronghold.planner.plan import make_plan

__all__ = ["Candidate", "HeteroPlan", "evaluate", "plan", "auto_plan", "format_hetero_plan",
           "hetero_plan_to_dict", "run_cluster_plan"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One costed layout."""

    tp: int
    """Tensor-parallel degree of every stage."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Replicas."""
    micro_batches: int
    """Micro-batches per step (M)."""
    stage_blocks: tuple[int, ...]
    """Blocks of each stage."""
    devices: tuple[tuple[tuple[int, ...], ...], ...]
    """devices[s][d]: the cluster device indices of stage s of replica d (its TP group)."""
    replica_batches: tuple[int, ...]
    """Samples per micro-batch of each replica (sum: global batch / M)."""
    windows: tuple[tuple[int, ...], ...]
    """windows[s][d]: W of each piece."""
    step_s: float
    """Predicted step time, seconds (inf when something does not fit)."""
    even_step_s: float
    """The same sizes with even stage and batch splits, seconds (inf when that does not fit)."""
    note: str = ""
    """Why it does not fit, or what limits it."""
    device_bytes: tuple[int, ...] = ()
    """Peak device bytes of each stage's most loaded GPU (the largest over its replicas)."""
    host_bytes: tuple[int, ...] = ()
    """Host store bytes per GPU of each stage (the largest over its replicas; the host reserve
    aside): each GPU's share of its node's host."""

    @property
    def rank_devices(self) -> list[int]:
        """The cluster device each global rank runs on, in the runtime's rank order (stage
        outermost, then replica, TP rank innermost): launch rank r on device rank_devices[r]."""
        return [d for stage in self.devices for group in stage for d in group]

    @property
    def speedup(self) -> float:
        """even_step_s / step_s: what hardware-aware balancing gains."""
        return self.even_step_s / self.step_s if math.isfinite(self.step_s) else 0.0

    def describe(self) -> str:
        """One line: sizes, splits, step time."""
        if not math.isfinite(self.step_s):
            return f"tp {self.tp} x pp {self.pp} x dp {self.dp}: does not fit ({self.note})"
        return (f"tp {self.tp} x pp {self.pp} x dp {self.dp}, {self.micro_batches} micro-batches: "
                f"blocks per stage {list(self.stage_blocks)}, samples per replica "
                f"{list(self.replica_batches)}, W per stage {[max(w) for w in self.windows]}; step "
                f"{self.step_s * 1e3:.1f} ms ({self.speedup:.2f}x the even split)")


@dataclass(frozen=True, slots=True)
class HeteroPlan:
    """The winner and the runners-up, best first."""

    config: GPTConfig
    """The model."""
    global_batch: int
    """Samples per step."""
    ranked: tuple[Candidate, ...]
    """Every candidate that fits, fastest first, then those that do not."""
    device_names: tuple[str, ...] = ()
    """The cluster's device names, by device index (for the explanation)."""
    seq: int = 0
    """Tokens per sample (0: not known)."""

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the winner over the whole cluster (0 when it does not fit)."""
        return self.global_batch * self.seq / self.winner.step_s if self.fits else 0.0

    @property
    def winner(self) -> Candidate:
        """The fastest candidate."""
        return self.ranked[0]

    @property
    def fits(self) -> bool:
        """The winner fits the cluster."""
        return math.isfinite(self.winner.step_s)


def _sorted_devices(cluster: Cluster) -> list[int]:
    devs = cluster.devices
    return sorted(range(len(devs)), key=lambda i: (-devs[i].memory_bytes, -devs[i].fp32_flops, i))


_PIECES: dict[str, tuple[float, float, int, int, int]] = {}


def _piece(config: GPTConfig, work: Workload, hw: Hardware, blocks: int, last: bool,
           in_flight: int) -> tuple[float, float, int, int, int]:
    """(seconds per micro-batch, seconds per step, W, peak device bytes, host store bytes) of
    ``blocks`` blocks on ``hw``: the
    micro-batch's compute and exposed transfers (without the loss when not ``last``), and the
    exposed host update, which runs once per step. ``in_flight`` micro-batches keep their block
    inputs on the device (1F1B: S - s at stage s). (inf, inf, 0, 0, 0) when it does not fit. Memoised:
    a search asks for the same piece many times (the key is the arguments' repr: Workload and
    Hardware are mutable dataclasses)."""
    key = repr((config, work, hw, blocks, last, in_flight))
    if key not in _PIECES:
        if len(_PIECES) > 100_000:
            _PIECES.clear()
        # every block streamed: the extra in-flight inputs below are checked against that plan's peak
        p = make_plan(dataclasses.replace(config, layers=blocks), work, hw, resident_blocks=0)
        extra = (in_flight - 1) * blocks * p.costs.block_input_bytes
        peak = max(p.device.backward_bytes + extra, p.device.step_bytes)  # inputs in flight: backward's
        if not p.fits or p.step is None or peak > p.device.capacity_bytes:
            _PIECES[key] = (math.inf, math.inf, 0, 0, 0)
        else:
            micro = p.step.compute_s + p.step.exposed_transfer_s - (0.0 if last else p.costs.head_tail_s)
            _PIECES[key] = (micro, p.step.exposed_optimizer_s, p.window, peak,
                            p.host.host_bytes - work.host_reserve_bytes)
    return _PIECES[key]


def _hardware(cluster: Cluster, device: int) -> Hardware:
    hw = cluster.hardware(device)
    share = len(cluster.node_of(device).devices)  # a node's devices share its host evenly
    return dataclasses.replace(hw, host_memory_bytes=hw.host_memory_bytes // share,
                               cpu_adam_params_per_s=hw.cpu_adam_params_per_s / share)


def _slowest(cluster: Cluster, group: tuple[int, ...], precision: str) -> int:
    devs = cluster.devices
    return min(group, key=lambda d: (devs[d].flops(precision), devs[d].memory_bytes))


class _Replica:
    """The cost of one replica (its pieces, one per stage) as a function of blocks and batch."""

    def __init__(self, cluster: Cluster, config: GPTConfig, work: Workload, placement, M: int):
        self.cluster, self.config, self.work, self.M = cluster, config, work, M
        self.S = len(placement)
        self.hw = [_hardware(cluster, _slowest(cluster, g, work.precision)) for g in placement]
        seq = work.seq or config.seq_len
        # activations forward and their gradients back, per sample, over the slowest stage link
        self.send_s_per_sample = max((2 * seq * config.hidden * work.dtype_bytes
                                      / cluster.link_bytes_per_s([placement[s][0], placement[s + 1][0]])
                                      for s in range(self.S - 1)), default=0.0)

    def piece(self, s: int, blocks: int, batch: int) -> tuple[float, float, int, int, int]:
        return _piece(self.config, dataclasses.replace(self.work, batch=batch), self.hw[s], blocks,
                      s == self.S - 1, self.S - s)

    def stage_s(self, s: int, blocks: int, batch: int) -> float:
        """Stage ``s`` alone as the bottleneck: (M + S - 1) micro-batches plus its host update."""
        micro, update = self.piece(s, blocks, batch)[:2]
        return (self.M + self.S - 1) * (micro + batch * self.send_s_per_sample) + update

    def step(self, stage_blocks, batch: int) -> tuple[float, list[tuple]]:
        """(seconds of one step, each stage's piece: ``_piece``'s figures) at ``batch`` samples per
        micro-batch."""
        pieces = [self.piece(s, k, batch) for s, k in enumerate(stage_blocks)]
        micro = max(p[0] for p in pieces) + batch * self.send_s_per_sample
        return (self.M + self.S - 1) * micro + max(p[1] for p in pieces), pieces


def _failed(base: dict, note: str, stage_blocks=()) -> Candidate:
    return Candidate(**base, stage_blocks=tuple(stage_blocks), replica_batches=(), windows=(),
                     step_s=math.inf, even_step_s=math.inf, note=note)


def _cost(cluster, config, work, tp, pp, dp, M, global_batch, balanced) -> Candidate:
    order = _sorted_devices(cluster)
    groups = [tuple(order[i:i + tp]) for i in range(0, len(order), tp)]
    devices = tuple(tuple(groups[s * dp + d] for d in range(dp)) for s in range(pp))
    per_micro = global_batch // M
    base = dict(tp=tp, pp=pp, dp=dp, micro_batches=M, devices=devices)
    if per_micro < dp:
        return _failed(base, f"{per_micro} samples per micro-batch for {dp} replicas")
    cfg = dataclasses.replace(config, tp_size=tp)
    replicas = [_Replica(cluster, cfg, work, [devices[s][d] for s in range(pp)], M) for d in range(dp)]
    even = per_micro // dp
    if balanced:  # stage s's time: its slowest replica's, at the even batch share
        try:
            stage_blocks = balance_stage_counts(
                cfg.layers, pp, lambda s, k: max(r.stage_s(s, k, even) for r in replicas))
            sizes = balance_batch_times(per_micro, [lambda b, r=r: r.step(stage_blocks, b)[0] for r in replicas])
        except ValueError as err:
            return _failed(base, str(err))
    else:
        q, r = divmod(cfg.layers, pp)
        stage_blocks = tuple(q + (1 if s < r else 0) for s in range(pp))
        sizes = [even + (1 if d < per_micro % dp else 0) for d in range(dp)]
    runs = [r.step(stage_blocks, b) for r, b in zip(replicas, sizes)]
    step = max(t for t, _ in runs)
    if not math.isfinite(step):
        return _failed(base, "a piece does not fit its device (memory)", stage_blocks)
    if dp > 1:  # gradients of the largest stage over its DP group, after the step (not overlapped)
        params = max(stage_blocks) * block_params_per_rank(cfg) + head_tail_params_per_rank(cfg)
        step += max(ring_allreduce_s(params * work.dtype_bytes, dp,
                                     cluster.link_bytes_per_s([g[0] for g in devices[s]]))
                    for s in range(pp))
    windows = tuple(tuple(runs[d][1][s][2] for d in range(dp)) for s in range(pp))
    device = tuple(max(runs[d][1][s][3] for d in range(dp)) for s in range(pp))
    host = tuple(max(runs[d][1][s][4] for d in range(dp)) for s in range(pp))
    return Candidate(**base, stage_blocks=tuple(stage_blocks), replica_batches=tuple(sizes), windows=windows,
                     step_s=step, even_step_s=math.inf, device_bytes=device, host_bytes=host)


def evaluate(config: GPTConfig, cluster: Cluster, *, tp: int = 1, pp: int = 1, micro_batches: int = 1,
             global_batch: int, work: Workload | None = None) -> Candidate:
    """Cost one layout (dp = devices / (tp * pp)) with hardware-aware splits, and its even-split twin."""
    work = work or Workload(precision="fp32")
    n = len(cluster.devices)
    for name, value in (("tp", tp), ("pp", pp), ("micro_batches", micro_batches), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n % (tp * pp):
        raise ValueError(f"tp={tp} x pp={pp} does not divide the cluster's {n} devices")
    if config.heads % tp:
        raise ValueError(f"tp={tp} must divide the model's {config.heads} attention heads")
    dataclasses.replace(config, tp_size=tp)  # a Hugging Face model: train's refusal (models.hf_tp.check_hf_tp)
    if pp > config.layers:
        raise ValueError(f"pp={pp} exceeds the model's {config.layers} blocks")
    if global_batch % micro_batches:
        raise ValueError(f"global_batch={global_batch} is not divisible by micro_batches={micro_batches}")
    dp = n // (tp * pp)
    aware = _cost(cluster, config, work, tp, pp, dp, micro_batches, global_batch, balanced=True)
    even = _cost(cluster, config, work, tp, pp, dp, micro_batches, global_batch, balanced=False)
    return dataclasses.replace(aware, even_step_s=even.step_s)


def _splits(config, tp: int) -> bool:
    """Whether ``config`` can be split over ``tp`` ranks (its heads; a Hugging Face model's family,
    head counts, MLP width and vocabulary: ``models.hf_tp.check_hf_tp``)."""
    try:
        dataclasses.replace(config, tp_size=tp)
    except ValueError:
        return False
    return config.heads % tp == 0


def _config_of(model) -> GPTConfig:
    if isinstance(model, GPTConfig) or hasattr(model, "block_params"):  # a GPTConfig or an HFShape
        return model
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):
        return config
    raise TypeError(f"model must be a GPT or a GPTConfig (the cost model knows GPT blocks), got "
                    f"{type(model).__name__}")


def _cluster_of(cluster, precision: str) -> Cluster:
    return cluster if isinstance(cluster, Cluster) else load_cluster(cluster, precision)


def _rank(config, global_batch, candidates, cluster: Cluster, work: Workload) -> HeteroPlan:
    ranked = sorted(candidates, key=lambda c: (c.step_s, c.tp * c.pp, c.tp))
    return HeteroPlan(config=config, global_batch=global_batch, ranked=tuple(ranked),
                      device_names=tuple(d.name for d in cluster.devices), seq=work.seq or config.seq_len)


def plan(model, cluster, *, global_batch: int | None = None, work: Workload | None = None) -> HeteroPlan:
    """The layout ``model``'s scopes describe (``pystronghold.strategy.layout_of``; a bare config:
    plain DP), costed on ``cluster`` (a ``Cluster`` or a file path) with hardware-aware splits.
    ``global_batch`` defaults to ``work.batch`` samples per device. The stages' TP degrees must be
    equal (one TP size per model in the runtime)."""
    work = work or Workload(precision="fp32")
    config = _config_of(model)
    cluster = _cluster_of(cluster, work.precision)
    if global_batch is None:
        global_batch = work.batch * len(cluster.devices)
    tp, pp, micro = 1, 1, 1
    if not isinstance(model, GPTConfig):
        from pystronghold.strategy import layout_of

        layout = layout_of(model, world_size=len(cluster.devices))
        tps = {s.tp_size for s in layout.stages}
        if len(tps) > 1:
            raise ValueError(f"stages with TP degrees {sorted(tps)}: the planner needs one split size")
        tp, pp, micro = tps.pop(), layout.pp_size, layout.num_micro_batch
    return _rank(config, global_batch, [evaluate(config, cluster, tp=tp, pp=pp, micro_batches=micro,
                                                 global_batch=global_batch, work=work)], cluster, work)


def auto_plan(model, cluster, *, global_batch: int | None = None, work: Workload | None = None,
              max_micro_batches: int = 16) -> HeteroPlan:
    """Search TP (within a node, dividing the heads), PP (dividing the rest), DP, and M in
    {1} without a pipeline, {pp, 2pp, 4pp, ...} <= ``max_micro_batches`` with one; every layout
    costed by ``evaluate`` (``global_batch`` as in ``plan``). Returns them all ranked, fastest first."""
    work = work or Workload(precision="fp32")
    config = _config_of(model)
    cluster = _cluster_of(cluster, work.precision)
    if global_batch is None:
        global_batch = work.batch * len(cluster.devices)
    n = len(cluster.devices)
    per_node = min(len(node.devices) for node in cluster.nodes)
    out = []
    for tp in (t for t in range(1, per_node + 1) if n % t == 0 and _splits(config, t)):
        for pp in (p for p in range(1, min(n // tp, config.layers) + 1) if (n // tp) % p == 0):
            micros = [1] if pp == 1 else [m for m in (pp * 2**k for k in range(8)) if m <= max_micro_batches]
            for m in micros:
                if global_batch % m == 0 and global_batch // m >= n // (tp * pp):
                    out.append(evaluate(config, cluster, tp=tp, pp=pp, micro_batches=m,
                                        global_batch=global_batch, work=work))
    if not out:
        raise ValueError(f"no layout of {n} devices runs a global batch of {global_batch}")
    return _rank(config, global_batch, out, cluster, work)


def _placement(result: HeteroPlan, c: Candidate) -> str:
    stages = []
    for s, stage in enumerate(c.devices):
        names: dict[str, int] = {}
        for group in stage:
            for d in group:
                names[result.device_names[d]] = names.get(result.device_names[d], 0) + 1
        stages.append(f"stage {s}: " + " + ".join(f"{n}x {name}" for name, n in names.items()))
    return "; ".join(stages)


def _span(values: tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return format_bytes(high) if low == high else f"{format_bytes(low)} to {format_bytes(high)}"


def format_hetero_plan(result: HeteroPlan, runners_up: int = 2) -> str:
    """The winner, where its pieces run, and ``runners_up`` more, each with why it ranks there."""
    win = result.winner
    lines = [f"global batch {result.global_batch}, {result.config.layers} blocks of width "
             f"{result.config.hidden}", f"winner: {win.describe()}"]
    if math.isfinite(win.step_s) and result.device_names:
        lines.append(f"  placement (largest memory first): {_placement(result, win)}")
        lines.append(f"  hardware-aware splits: {win.even_step_s * 1e3:.1f} ms with even ones"
                     if math.isfinite(win.even_step_s) else "  the even splits do not fit")
    if math.isfinite(win.step_s) and result.seq:
        lines.append(f"  {result.tokens_per_s:,.0f} tokens/s ({result.seq} tokens per sample); per GPU: device peak "
                     f"{_span(win.device_bytes)}, host store {_span(win.host_bytes)} (over the stages)")
    for i, c in enumerate(result.ranked[1:1 + runners_up], 2):
        why = (f"{c.step_s / win.step_s:.2f}x the winner's step time" if math.isfinite(c.step_s)
               else c.note)
        lines.append(f"#{i}: {c.describe()}  [{why}]")
    return "\n".join(lines)


def hetero_plan_to_dict(result: HeteroPlan) -> dict:
    """The ranking as plain data (seconds; inf as None), for ``--json``."""
    def one(c: Candidate) -> dict:
        finite = math.isfinite(c.step_s)
        return dict(tp=c.tp, pp=c.pp, dp=c.dp, micro_batches=c.micro_batches,
                    stage_blocks=list(c.stage_blocks), replica_batches=list(c.replica_batches),
                    devices=[[list(g) for g in stage] for stage in c.devices],
                    windows=[list(w) for w in c.windows], step_s=c.step_s if finite else None,
                    even_step_s=c.even_step_s if math.isfinite(c.even_step_s) else None,
                    speedup=c.speedup if finite else None, note=c.note,
                    device_bytes=list(c.device_bytes), host_bytes=list(c.host_bytes))

    return dict(global_batch=result.global_batch, seq=result.seq, fits=result.fits,
                tokens_per_s=result.tokens_per_s, ranked=[one(c) for c in result.ranked])


def run_cluster_plan(request) -> int:
    """``pystronghold plan --cluster PATH``: 0 when the winner fits, 1 when nothing does; a bad
    request raises ValueError (the command prints it and exits 2)."""
    import json
    import sys

    from pystronghold.models.hf import NO_POSITION_LIMIT
    from pystronghold.planner.trainable import check_freeze

    config = request.model_config()
    if request.seq is None and config.seq_len == NO_POSITION_LIMIT:
        raise ConfigError(f"--cluster: the model ({request.model}) names no position limit: give --seq")
    check_freeze(config, request.finetune)
    rt = request.runtime
    work = Workload(seq=request.seq, precision=rt.precision, checkpointing=rt.checkpointing,
                    overlap=request.overlap, compute_efficiency=request.efficiency, finetune=request.finetune)
    cluster = load_cluster(request.cluster, rt.precision)
    global_batch = request.global_batch or request.batch * len(cluster.devices)
    result = auto_plan(config, cluster, global_batch=global_batch, work=work)
    print(json.dumps(hetero_plan_to_dict(result), indent=2) if request.json else format_hetero_plan(result),
          file=sys.stdout)
    return 0 if result.fits else 1
