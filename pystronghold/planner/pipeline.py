"""The pipeline's share of the plan: bubble, in-flight activations and point-to-point bytes.

With p stages and m micro-batches per step, a stage computes m forwards and m backwards and waits
for the others to fill and drain the pipeline for p - 1 micro-batch slots (Narayanan et al., SC'21):

    bubble fraction = (p - 1) / m            (GPipe and 1F1B: idle time / compute time)
                    = (1 / v) * (p - 1) / m  (interleaved, v model chunks per rank)

1F1B keeps the activations of at most ``p - s`` micro-batches on stage s (its warm-up forwards),
GPipe all m. The interleaved schedule (v model chunks per rank, p * v balanced chunks, rank r
holding chunks r, r + p, ...) keeps (v - 1) * p + 2 * (p - 1 - s) + 1 chunk forwards in flight on
rank s (torch's ScheduleInterleaved1F1B, m a multiple of p), each holding one chunk's activations:
more than 1F1B's p - s whole-stage micro-batches, the price of the smaller bubble. Under checkpointing, a micro-batch in flight holds each of the stage's block inputs
(B*T*C*s bytes per block); without it, every block's saved activations (``block_activation_bytes``).
Between two stages, each micro-batch sends its activation forward and receives its gradient back:
B*T*C*s bytes each way, per TP rank (every TP rank holds the whole activation).
"""

from __future__ import annotations

from dataclasses import dataclass

from pystronghold.models.gpt import GPTConfig
from pystronghold.planner.cost import Workload, block_activation_bytes

__all__ = ["bubble_fraction", "in_flight_micro_batches", "PipelinePlan", "plan_pipeline"]


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

    def stage_split(self, stage: int) -> list[range]:
        """The block ranges rank ``stage`` holds (its chunks, chunk 0 first)."""
        from pystronghold.parallel.pipeline import rank_stages

        return [self.split[s] for s in rank_stages(stage, self.stages, self.chunks)]

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
            out.append(f"  stage {s}: {parts}, {100 * share:.1f}% of FLOPs, {n} {what} in flight: "
                       f"{act / 2**20:,.1f} MiB of activations")
        return out

    def to_dict(self) -> dict:
        """JSON-serialisable figures (bytes)."""
        return {"stages": self.stages, "micro_batches": self.micro_batches, "schedule": self.schedule,
                "chunks": self.chunks, "split": [[r.start, r.stop] for r in self.split],
                "stage_flop_share": self.stage_flop_share, "bubble_fraction": self.bubble,
                "in_flight": self.in_flight, "activation_bytes": self.activation_bytes,
                "p2p_bytes_per_micro_batch": self.p2p_bytes}


def plan_pipeline(config: GPTConfig, work: Workload, stages: int, micro_batches: int,
                  schedule: str = "1f1b", chunks: int = 1) -> PipelinePlan:
    """The pipeline figures of ``config`` trained as ``work`` (``work.batch``: the micro-batch);
    ``chunks``: model chunks per rank (2 or more with ``schedule="interleaved"``)."""
    from pystronghold.parallel.pipeline import rank_stages, validate_pipeline
    from pystronghold.parallel.pipeline_gpt import gpt_stage_costs
    from pystronghold.planner.balance import stage_ranges

    validate_pipeline(stages, config.layers, micro_batches, schedule, chunks)
    seq = work.seq or config.seq_len
    costs, head, tail = gpt_stage_costs(config, seq)
    n = stages * chunks
    split = stage_ranges(costs, n, head_cost=head, tail_cost=tail)
    total = sum(costs) + head + tail
    ranks = [rank_stages(s, stages, chunks) for s in range(stages)]  # each rank's chunks (virtual stages)
    share = [sum(sum(costs[split[i].start:split[i].stop]) + (head if i == 0 else 0.0) + (tail if i == n - 1 else 0.0)
                 for i in mine) / total for mine in ranks]
    boundary = work.batch * seq * config.hidden * work.dtype_bytes  # one activation, B*T*C*s
    per_block = boundary if work.checkpointing else block_activation_bytes(config, work, seq)
    in_flight = [in_flight_micro_batches(schedule, s, stages, micro_batches, chunks) for s in range(stages)]
    # each in-flight forward holds one chunk's activations: an upper bound, its largest chunk's
    activations = [k * max(len(split[i]) for i in mine) * per_block for k, mine in zip(in_flight, ranks)]
    return PipelinePlan(stages=stages, micro_batches=micro_batches, schedule=schedule, split=split,
                        stage_flop_share=share, bubble=bubble_fraction(stages, micro_batches, chunks),
                        in_flight=in_flight, activation_bytes=activations, p2p_bytes=boundary, chunks=chunks,
                        per_block_bytes=per_block)
