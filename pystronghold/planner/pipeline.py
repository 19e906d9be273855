"""The pipeline's share of the plan: bubble, in-flight activations and point-to-point bytes.

With p stages and m micro-batches per step, a stage computes m forwards and m backwards and waits
for the others to fill and drain the pipeline for p - 1 micro-batch slots (Narayanan et al., SC'21):

    bubble fraction = (p - 1) / m            (GPipe and 1F1B: idle time / compute time)
                    = (1 / v) * (p - 1) / m  (interleaved, v model chunks per rank)

1F1B keeps the activations of at most ``p - s`` micro-batches on stage s (its warm-up forwards),
GPipe all m. Under checkpointing, a micro-batch in flight holds each of the stage's block inputs
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


def in_flight_micro_batches(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once (forward done, backward not)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, stages - stage)
    raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")


@dataclass(slots=True)
class PipelinePlan:
    """Figures of a pipeline layout (per TP rank; bytes and fractions)."""

    stages: int
    micro_batches: int
    schedule: str
    split: list[range]
    """Blocks of each stage (``balance.stage_ranges`` on FLOPs, head and LM head counted)."""
    stage_flop_share: list[float]
    """Each stage's share of the forward FLOPs."""
    bubble: float
    """Idle time / compute time of a stage, (p-1)/m."""
    in_flight: list[int]
    """Micro-batches in flight on each stage at its peak."""
    activation_bytes: list[int]
    """Bytes of in-flight activations on each stage at its peak."""
    p2p_bytes: int
    """Bytes one micro-batch sends across one stage boundary, each way (activation forward,
    gradient backward)."""

    def lines(self) -> list[str]:
        """The report's pipeline section."""
        out = [f"pipeline  {self.stages} stages, {self.micro_batches} micro-batches, {self.schedule}: bubble "
               f"{100 * self.bubble:.1f}% of compute ((p-1)/m), p2p {self.p2p_bytes / 2**20:,.2f} MiB per "
               "micro-batch per boundary each way"]
        for s, (blocks, share, n, act) in enumerate(zip(self.split, self.stage_flop_share, self.in_flight,
                                                        self.activation_bytes)):
            parts = ("head + " if s == 0 else "") + f"blocks {blocks.start}-{blocks.stop - 1}" + \
                    (" + LM head" if s == self.stages - 1 else "")
            out.append(f"  stage {s}: {parts}, {100 * share:.1f}% of FLOPs, {n} micro-batches in flight: "
                       f"{act / 2**20:,.1f} MiB of activations")
        return out

    def to_dict(self) -> dict:
        """JSON-serialisable figures (bytes)."""
        return {"stages": self.stages, "micro_batches": self.micro_batches, "schedule": self.schedule,
                "split": [[r.start, r.stop] for r in self.split], "stage_flop_share": self.stage_flop_share,
                "bubble_fraction": self.bubble, "in_flight": self.in_flight,
                "activation_bytes": self.activation_bytes, "p2p_bytes_per_micro_batch": self.p2p_bytes}


def plan_pipeline(config: GPTConfig, work: Workload, stages: int, micro_batches: int,
                  schedule: str = "1f1b") -> PipelinePlan:
    """The pipeline figures of ``config`` trained as ``work`` (``work.batch``: the micro-batch)."""
    from pystronghold.parallel.pipeline import gpt_stage_costs, validate_pipeline
    from pystronghold.planner.balance import stage_ranges

    validate_pipeline(stages, config.layers, micro_batches, schedule)
    seq = work.seq or config.seq_len
    costs, head, tail = gpt_stage_costs(config, seq)
    split = stage_ranges(costs, stages, head_cost=head, tail_cost=tail)
    total = sum(costs) + head + tail
    share = [(sum(costs[r.start:r.stop]) + (head if s == 0 else 0.0) + (tail if s == stages - 1 else 0.0)) / total
             for s, r in enumerate(split)]
    boundary = work.batch * seq * config.hidden * work.dtype_bytes  # one activation, B*T*C*s
    per_block = boundary if work.checkpointing else block_activation_bytes(config, work, seq)
    in_flight = [in_flight_micro_batches(schedule, s, stages, micro_batches) for s in range(stages)]
    activations = [n * len(r) * per_block for n, r in zip(in_flight, split)]
    return PipelinePlan(stages=stages, micro_batches=micro_batches, schedule=schedule, split=split,
                        stage_flop_share=share, bubble=bubble_fraction(stages, micro_batches),
                        in_flight=in_flight, activation_bytes=activations, p2p_bytes=boundary)
