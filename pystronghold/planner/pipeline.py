"""The pipeline's arithmetic: stage placement, passes and costs.

Pure functions of the layout (its settings and their one check: ``settings.parallel``), read by the
pipeline runtime, ``train`` and ``plan``: ``rank_stages``, ``stage_passes``/``rank_passes`` (placement and
schedule order); ``gpt_stage_costs``/``stage_split`` (the FLOPs-balanced block split). With p
stages and m micro-batches the bubble fraction is (p - 1) / m, divided by v for the interleaved
schedule (Narayanan et al., SC'21); between stages each micro-batch sends B*T*C*s bytes each way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pystronghold.models.gpt import GPTConfig
from pystronghold.planner.balance import stage_ranges
from pystronghold.planner.cost import Workload, block_activation_bytes, block_forward_flops, block_params_per_rank
from pystronghold.planner.hardware import format_bytes
from pystronghold.planner.params import stage_end_params
from pystronghold.planner.trainable import param_split
from pystronghold.settings.parallel import ParallelOptions, check_pipeline

__all__ = ["rank_stages", "stage_passes", "rank_passes",
           "gpt_stage_costs", "stage_split", "even_split", "bubble_fraction", "in_flight_micro_batches", "PipelinePlan",
           "plan_pipeline", "LinkBytes", "link_bytes"]

# ---- which stage holds which blocks, and the passes it runs

def rank_stages(rank: int, stages: int, chunks: int = 1) -> range:
    """The virtual stages pipeline rank ``rank`` holds of ``stages`` x ``chunks``, chunk 0 first
    (the interleaved placement: chunk c is virtual stage ``rank + c * stages``; one chunk: the stage
    ``rank`` itself). Its inverse: virtual stage s is chunk ``s // stages`` of rank ``s % stages``."""
    return range(rank, stages * chunks, stages)


def stage_passes(schedule: str, stage: int, stages: int, micro_batches: int) -> list[str]:
    """The passes ("fwd"/"bwd", one per micro-batch each) stage ``stage`` runs in one step, in the
    order torch's schedule runs them (Schedule1F1B: ``min(m, p - stage)`` forwards, then one
    backward and one forward alternately, then the remaining backwards; ScheduleGPipe: every
    forward, then every backward). The engine checks each block use against this order."""
    m = micro_batches
    if schedule == "gpipe":
        return ["fwd"] * m + ["bwd"] * m
    if schedule == "1f1b":
        warmup = min(m, stages - stage)
        passes = ["fwd"] * warmup
        forwards = warmup
        backwards = 0
        while backwards < m:
            passes.append("bwd")
            backwards += 1
            if forwards < m:
                passes.append("fwd")
                forwards += 1
        return passes
    raise ValueError(f"stage_passes: schedule must be '1f1b' or 'gpipe' (interleaved: rank_passes), "
                     f"got {schedule!r}")


def rank_passes(actions, stages: int) -> list[tuple[int, str]]:
    """The passes one rank runs in a step of a multi-stage torch schedule, from its action list
    (``schedule.pipeline_order[rank]``: ``_Action(stage_index, computation_type, microbatch_index)``
    or None for an idle slot): ``(chunk, "fwd" | "bwd")`` in order, where virtual stage
    ``stage_index`` is chunk ``stage_index // stages`` of rank ``stage_index % stages``. Only
    forwards and full backwards are taken (a schedule that splits the backward, e.g. zero bubble,
    would run each block's backward twice): ValueError for another action."""
    passes = []
    for action in actions:
        if action is None:
            continue
        computation = action.computation_type  # a str enum: "F" forward, "B" full backward
        kind = "fwd" if computation == "F" else "bwd" if computation == "B" else None
        if kind is None:
            raise ValueError(f"rank_passes: action {action} is not a forward (F) or a full backward (B)")
        passes.append((action.stage_index // stages, kind))
    return passes


def gpt_stage_costs(config, seq: int) -> tuple[list[float], float, float]:
    """(per-block, head, tail) forward FLOPs per sample of a ``GPTConfig`` (or an ``HFShape``): blocks by the planner's
    formula; the head's embedding lookup and add (2*T*C); the tail's LM head (2*T*C*V)."""
    block = block_forward_flops(config, 1, seq)
    head = 2.0 * seq * config.hidden
    tail = 2.0 * seq * config.hidden * config.padded_vocab_size / config.tp_size
    return [block] * config.layers, head, tail


def stage_split(config, seq: int, virtual_stages: int) -> tuple[list[range], list[float], float, float]:
    """The balanced block split of a ``GPTConfig`` over ``virtual_stages`` (``balance.stage_ranges``
    on ``gpt_stage_costs``), with the costs it balanced: (split, per-block, head, tail)."""
    costs, head, tail = gpt_stage_costs(config, seq)
    return stage_ranges(costs, virtual_stages, head_cost=head, tail_cost=tail), costs, head, tail


def even_split(blocks: int, virtual_stages: int) -> list[range]:
    """The block split of a model whose ``blocks`` blocks cost alike (a Hugging Face model's) over
    ``virtual_stages``: contiguous, non-empty, the sizes differing by one at most."""
    return stage_ranges([1.0] * blocks, virtual_stages)


# ---- the pipeline's share of the plan



def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle time of a stage over its compute time in one step: (1 / chunks) * (stages - 1) / micro_batches."""
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(f"stages, micro_batches and chunks must be >= 1, got {stages}, {micro_batches}, {chunks}")
    return (stages - 1) / (chunks * micro_batches)


def in_flight_micro_batches(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once (forward done, backward not);
    interleaved: chunk forwards (each holds one model chunk's activations) in flight on rank
    ``stage``: its warm-up forwards, (v - 1) * p + 2 * (p - 1 - stage) with m a multiple of p, plus
    the first steady-state forward, at most all v * m (torch's ScheduleInterleaved1F1B)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    if schedule == "interleaved":
        total = chunks * micro_batches
        warmup = min((chunks - 1) * stages + 2 * (stages - 1 - stage), total)
        return min(warmup + 1, total)
    raise ValueError(f"schedule must be '1f1b', 'gpipe' or 'interleaved', got {schedule!r}")


@dataclass(slots=True)
class PipelinePlan:
    """Figures of a pipeline layout (per TP rank; bytes and fractions)."""

    stages: int
    micro_batches: int
    schedule: str
    split: list[range]
    """Blocks of each stage (``balance.stage_ranges`` on FLOPs, head and LM head counted); with
    ``chunks`` > 1, of each of the p * v model chunks in model order (rank r holds r, r + p, ...)."""
    stage_flop_share: list[float]
    """Each stage's (rank's) share of the forward FLOPs."""
    bubble: float
    """Idle time / compute time of a stage, (1/v)(p-1)/m."""
    in_flight: list[int]
    """Micro-batches in flight on each stage at its peak (interleaved: chunk forwards)."""
    activation_bytes: list[int]
    """Bytes of in-flight activations on each stage at its peak."""
    p2p_bytes: int
    """Bytes one micro-batch sends across one stage boundary, each way (activation forward,
    gradient backward)."""
    chunks: int = 1
    """Model chunks per rank (v; the interleaved schedule): each rank then sends v activations per
    micro-batch (one per chunk boundary it owns), each of ``p2p_bytes``."""
    per_block_bytes: int = 0
    """Bytes one micro-batch in flight keeps per block (its block input under recompute)."""
    stage_params: list[int] = field(default_factory=list)
    """Parameters each rank (stage) holds on one TP rank: its blocks', the embedding on the first,
    the final norm and LM head on the last (a tied embedding counted on both)."""

    def stage_split(self, stage: int) -> list[range]:
        """The block ranges rank ``stage`` holds (its chunks, chunk 0 first)."""
        return [self.split[s] for s in rank_stages(stage, self.stages, self.chunks)]

    def step_s(self, stage_step_s: float) -> float:
        """Seconds of one step of the pipeline whose largest stage takes ``stage_step_s`` for one
        micro-batch: m of them, stretched by the bubble, m * stage * (1 + bubble)."""
        return self.micro_batches * stage_step_s * (1 + self.bubble)

    def stage_blocks(self, stage: int) -> int:
        """Blocks rank ``stage`` holds."""
        return sum(len(r) for r in self.stage_split(stage))

    def stage_in_flight(self, stage: int) -> int:
        """``in_flight`` of rank ``stage`` in whole-stage micro-batches (each holding every block of
        the stage; rounded up): what the device memory of ``planner.plan.make_plan`` counts."""
        return -(-self.activation_bytes[stage] // max(1, self.stage_blocks(stage) * self.per_block_bytes))

    def lines(self) -> list[str]:
        """The report's pipeline section."""
        what = "micro-batches" if self.chunks == 1 else "chunk forwards"
        shape = f"{self.stages} stages" + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
        formula = "(p-1)/m" if self.chunks == 1 else "(1/v)(p-1)/m"
        out = [f"pipeline  {shape}, {self.micro_batches} micro-batches, {self.schedule}: bubble "
               f"{100 * self.bubble:.1f}% of compute ({formula}), p2p {self.p2p_bytes / 2**20:,.2f} MiB per "
               "micro-batch per boundary each way" + (f" ({self.chunks} boundaries per rank)" if self.chunks > 1 else "")]
        last = len(self.split) - 1
        for s, (share, n, act) in enumerate(zip(self.stage_flop_share, self.in_flight, self.activation_bytes)):
            parts = ", ".join(("head + " if r.start == 0 else "") + f"blocks {r.start}-{r.stop - 1}" +
                              (" + LM head" if r is self.split[last] else "") for r in self.stage_split(s))
            params = f"{self.stage_params[s] / 1e9:,.3f}B params, " if self.stage_params else ""
            out.append(f"  stage {s}: {parts}, {params}{100 * share:.1f}% of FLOPs, {n} {what} in flight: "
                       f"{act / 2**20:,.1f} MiB of activations")
        return out

    def to_dict(self) -> dict:
        """JSON-serialisable figures (bytes)."""
        return {"stages": self.stages, "micro_batches": self.micro_batches, "schedule": self.schedule,
                "chunks": self.chunks, "split": [[r.start, r.stop] for r in self.split],
                "stage_flop_share": self.stage_flop_share, "bubble_fraction": self.bubble,
                "in_flight": self.in_flight, "activation_bytes": self.activation_bytes,
                "p2p_bytes_per_micro_batch": self.p2p_bytes, "stage_params": self.stage_params}


def plan_pipeline(config: GPTConfig, work: Workload, stages: int, micro_batches: int,
                  schedule: str = "1f1b", chunks: int = 1) -> PipelinePlan:
    """The pipeline figures of ``config`` (a ``GPTConfig`` or an ``HFShape``) trained as ``work``
    (``work.batch``: the micro-batch); ``chunks``: model chunks per rank (2 or more with
    ``schedule="interleaved"``). The blocks split as the runtime splits them: our GPT's balanced by
    FLOPs (``stage_split``), a Hugging Face model's evenly (``even_split``, as ``pipelining/hf.py``)."""
    check_pipeline(ParallelOptions(pp=stages, micro_batches=micro_batches, pp_schedule=schedule,
                                   pp_chunks=chunks), config.layers)
    micro_batches = micro_batches or stages
    seq = work.seq or config.seq_len
    n = stages * chunks
    costs, head, tail = gpt_stage_costs(config, seq)
    split = stage_split(config, seq, n)[0] if isinstance(config, GPTConfig) else even_split(config.layers, n)
    total = sum(costs) + head + tail
    ranks = [rank_stages(s, stages, chunks) for s in range(stages)]  # each rank's chunks (virtual stages)
    share = [sum(sum(costs[split[i].start:split[i].stop]) + (head if i == 0 else 0.0) + (tail if i == n - 1 else 0.0)
                 for i in mine) / total for mine in ranks]
    boundary = work.batch * seq * config.hidden * work.dtype_bytes  # one activation, B*T*C*s
    per_block = boundary if work.checkpointing else block_activation_bytes(config, work, seq)
    in_flight = [in_flight_micro_batches(schedule, s, stages, micro_batches, chunks) for s in range(stages)]
    # each in-flight forward holds one chunk's activations: an upper bound, its largest chunk's
    activations = [k * max(len(split[i]) for i in mine) * per_block for k, mine in zip(in_flight, ranks)]
    first, last = stage_end_params(config)
    block = block_params_per_rank(config)
    params = [sum(len(split[i]) for i in mine) * block + (first if 0 in mine else 0) + (last if n - 1 in mine else 0)
              for mine in ranks]
    return PipelinePlan(stages=stages, micro_batches=micro_batches, schedule=schedule, split=split,
                        stage_flop_share=share, bubble=bubble_fraction(stages, micro_batches, chunks),
                        in_flight=in_flight, activation_bytes=activations, p2p_bytes=boundary, chunks=chunks,
                        per_block_bytes=per_block, stage_params=params)


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes one rank sends over its links in one step (ring collectives: 2(n-1)/n of the reduced
    bytes each), in the compute precision."""

    tp: int
    """Tensor-parallel all-reduces of its blocks' activations and their gradients: B*T*C*s each, two
    per block in forward, two in backward and two more in a recomputed block's forward again (the
    embedding's and the loss's small ones aside)."""
    pp: int
    """Pipeline activations forward and their gradients back, B*T*C*s each per micro-batch and
    model chunk (a middle stage's both ways; the first and last stages send one way)."""
    dp: int
    """The data-parallel all-reduce of its trainable gradients (its blocks', head's and tail's)."""

    @property
    def total(self) -> int:
        """All three."""
        return self.tp + self.pp + self.dp

    def line(self) -> str:
        """The report's line."""
        return (f"links     per rank and step, sent: TP all-reduces {format_bytes(self.tp)}, PP activations "
                f"{format_bytes(self.pp)}, DP gradient all-reduce {format_bytes(self.dp)}")

    def to_dict(self) -> dict:
        """JSON-serialisable figures (bytes)."""
        return {"tp_bytes": self.tp, "pp_bytes": self.pp, "dp_bytes": self.dp, "total_bytes": self.total}


def link_bytes(config, work: Workload, pipeline: PipelinePlan | None = None,
               recomputed_blocks: int | None = None) -> LinkBytes:
    """The ``LinkBytes`` of the busiest rank of ``config`` (at its ``tp_size``) trained as ``work``
    (``work.dp_size`` replicas), through ``pipeline``'s stages (its largest; None: one stage, one
    micro-batch). ``recomputed_blocks``: of that rank's blocks, those that recompute their forward
    (a plan's ``recomputed_blocks``); None: all of them with ``work.checkpointing``, else none."""
    seq, t, d, s = work.seq or config.seq_len, config.tp_size, work.dp_size, work.dtype_bytes
    activation = work.batch * seq * config.hidden * s
    if pipeline is None:
        micro, chunks, blocks, pp = 1, 1, config.layers, 0
    else:
        micro, chunks = pipeline.micro_batches, pipeline.chunks
        blocks = max(pipeline.stage_blocks(r) for r in range(pipeline.stages))
        pp = 2 * micro * chunks * pipeline.p2p_bytes
    ring = lambda n, ranks: 0 if ranks <= 1 else 2 * (ranks - 1) * n // ranks  # noqa: E731
    if recomputed_blocks is None:
        recomputed_blocks = blocks if work.checkpointing else 0
    split = param_split(config, work.finetune)
    trainable = blocks * sum(split.block_trainable) + split.head_tail_trainable
    all_reduces = 4 * blocks + 2 * recomputed_blocks
    return LinkBytes(tp=ring(micro * all_reduces * activation, t), pp=pp, dp=ring(trainable * s, d))
