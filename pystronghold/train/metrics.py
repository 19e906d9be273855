"""What ``pystronghold train`` reports: the per-interval metrics line, the memory report and where
time went.

The metrics line has the fixed fields ``METRIC_FIELDS`` (step, mean loss, ms/step, tok/s, h2d and
d2h GB/s, device peak, host bytes, overlap %), from the engine's ``TraceSummary`` over the
interval; ``-`` where nothing of that kind moved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pystronghold.planner.hardware import format_bytes
from pystronghold.runtime.tracing.host_time import HOST_KINDS
from pystronghold.runtime.memory.layout import device_bytes_per_param
from pystronghold.runtime.tracing.trace import Tracer

__all__ = ["METRIC_FIELDS", "IntervalMetrics", "summarize_events", "MemoryReport", "memory_report",
           "TimeReport", "format_bytes", "MetricsWriter", "OutputWriteError", "TrainResult"]

METRIC_FIELDS = ("step", "loss", "ms/step", "tok/s", "h2d", "d2h", "dev peak", "host", "overlap")
"""Fields of a metrics line, in order."""


def format_rate(per_s: float) -> str:
    """A throughput for the log: whole numbers, three significant digits below 10 (a 30 B model on
    two cores trains 0.37 tokens/s, which printed as 0)."""
    return f"{per_s:.0f}" if per_s >= 10 else f"{per_s:.3g}"


def summarize_events(events):
    """``TraceSummary`` of a list of ``TraceEvent`` (e.g. the events of one logging interval)."""
    tracer = Tracer(enabled=True)
    for e in events:
        tracer.record(e.kind, e.block, e.start_s, e.end_s, e.nbytes, e.lane)
    return tracer.summary()


@dataclass(slots=True)
class IntervalMetrics:
    """Figures of one logging interval (the steps since the previous line)."""

    step: int
    """Optimizer steps done at the end of the interval."""
    loss: float
    """Mean training loss over the interval's steps."""
    ms_per_step: float
    """Wall milliseconds per optimizer step."""
    tokens_per_s: float
    """Training tokens per wall second (micro-batches x B x T)."""
    h2d_gbps: float | None
    """Achieved host-to-device bandwidth while loads were in flight, GB/s (1e9 B/s)."""
    d2h_gbps: float | None
    """Achieved device-to-host bandwidth while gradient copies were in flight, GB/s."""
    device_peak_bytes: int
    """Peak device bytes (CUDA: max_memory_allocated; CPU: window arena + head/tail state)."""
    host_bytes: int
    """Bytes of the host store (every block's master, moments, gradient, shadow)."""
    overlap: float | None
    """Fraction of transfer and host-update time hidden behind compute, in [0, 1]."""
    skipped_steps: int = 0
    """fp16 steps of the interval skipped for inf/NaN gradients (in the JSONL and TensorBoard
    figures, not on the line: each skip is logged when it happens)."""
    loss_steps: int = 1
    """Steps ``loss`` is the mean of (the interval's)."""

    @classmethod
    def of(cls, engine, summary, *, step: int, losses: list[float], elapsed_s: float, tokens: int,
           skipped_steps: int) -> IntervalMetrics:
        """The figures of an interval of ``engine`` ending at ``step``: ``losses``, one per step,
        over ``elapsed_s`` wall seconds training ``tokens``; ``summary``: its trace's
        ``summarize_events``."""
        return cls(step=step, loss=sum(losses) / len(losses), loss_steps=len(losses),
                   ms_per_step=1e3 * elapsed_s / len(losses), tokens_per_s=tokens / elapsed_s,
                   h2d_gbps=summary.gbps.get("h2d"), d2h_gbps=summary.gbps.get("d2h"),
                   device_peak_bytes=device_peak_bytes(engine), host_bytes=engine.memory_report().host_store_bytes,
                   overlap=summary.overlap_fraction, skipped_steps=skipped_steps)

    def line(self) -> str:
        """The fixed-field metrics line. NOTE: its loss says when it is a mean, apart from the
        progress bar's, which is the last step's."""
        def gbps(v):
            return "-" if v is None else f"{v:.2f} GB/s"
        overlap = "-" if self.overlap is None else f"{100 * self.overlap:.1f}%"
        mean = f" (mean of {self.loss_steps} steps)" if self.loss_steps > 1 else ""
        return (f"step {self.step} | loss {self.loss:.4f}{mean} | ms/step {self.ms_per_step:.1f} | "
                f"tok/s {format_rate(self.tokens_per_s)} | h2d {gbps(self.h2d_gbps)} | d2h {gbps(self.d2h_gbps)} | "
                f"dev peak {format_bytes(self.device_peak_bytes)} | host {format_bytes(self.host_bytes)} | "
                f"overlap {overlap}")

    def as_dict(self) -> dict:
        """The line's figures by field name (units as the fields say: bytes, GB/s, fraction)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class OutputWriteError(OSError):
    """Writing an output of the run failed; the message names its option and path
    (``--metrics-file FILE: ...``), so the CLI prints it as it is."""

    def __init__(self, flag: str, path, what: str, e: OSError) -> None:
        super().__init__(e.errno, f"{flag} {path}: {what}: {e.strerror or e}")

    def __str__(self) -> str:
        return self.strerror  # the message alone, without "[Errno N]"


class MetricsWriter:
    """Metrics lines also as JSONL (``--metrics-file``) and TensorBoard scalars (``--tensorboard``).

    A run resumed after ``resumed_step`` steps trains the steps after it again, so what an earlier
    process wrote for them is dropped: the JSONL file keeps only its records of steps up to
    ``resumed_step``, and TensorBoard purges its later events (``purge_step``). ``resumed_step`` 0:
    a new run (the file is overwritten)."""

    def __init__(self, jsonl: str | None, tensorboard: str | None, *, resumed_step: int = 0) -> None:
        self._jsonl, self._tensorboard = jsonl, tensorboard
        self._file = None
        if jsonl:
            try:
                if resumed_step > 0:
                    _keep_records_up_to(Path(jsonl), resumed_step)
                self._file = open(jsonl, "a" if resumed_step > 0 else "w", encoding="utf-8")
            except OSError as e:
                raise OutputWriteError("--metrics-file", jsonl, "cannot open it", e) from None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            try:
                self._tb = SummaryWriter(tensorboard, purge_step=resumed_step + 1 if resumed_step > 0 else None)
            except OSError as e:
                self.close()
                raise OutputWriteError("--tensorboard", tensorboard, "cannot write there", e) from None

    def _write_line(self, record: dict) -> None:
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            file, self._file = self._file, None  # NOTE: closing flushes the same bytes again: ignore that
            try:
                file.close()
            except OSError:
                pass
            raise OutputWriteError("--metrics-file", self._jsonl, f"writing step {record['step']}", e) from None

    def interval(self, m: IntervalMetrics) -> None:
        """Write one metrics line's figures (a JSON object; TensorBoard scalars under ``train/``).
        ``OutputWriteError`` when a write fails."""
        if self._file is not None:
            self._write_line(m.as_dict())
        if self._tb is not None:
            for name, value in m.as_dict().items():
                if name != "step" and value is not None:
                    self._tb.add_scalar(f"train/{name}", value, m.step)

    def validation(self, step: int, loss: float) -> None:
        """A validation loss (TensorBoard ``val/loss``; a ``{"step", "val_loss"}`` JSON object)."""
        if self._file is not None:
            self._write_line({"step": step, "val_loss": loss})
        if self._tb is not None:
            self._tb.add_scalar("val/loss", loss, step)

    def close(self) -> None:
        file, self._file = self._file, None
        tb, self._tb = self._tb, None
        try:
            if file is not None:
                try:
                    file.close()
                except OSError as e:
                    raise OutputWriteError("--metrics-file", self._jsonl, "closing it", e) from None
        finally:
            if tb is not None:
                try:
                    tb.close()
                except OSError as e:
                    raise OutputWriteError("--tensorboard", self._tensorboard, "closing it", e) from None


def _keep_records_up_to(path: Path, step: int) -> None:
    """Rewrite the JSONL file ``path`` (if any) with only its records of steps <= ``step``; a line
    that is no JSON record (torn by a killed run) goes too. Atomic: a temporary file renamed."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


@dataclass(slots=True)
class MemoryReport:
    """Device window vs what the model would need resident, and the host store by tier (bytes)."""

    window: int
    """W: blocks on the device at once."""
    blocks: int
    """Blocks of the model."""
    window_bytes: int
    """Device arena of the W slots (parameters + gradients in compute precision)."""
    head_tail_bytes: int
    """Head and tail on the device: parameters, gradients, fp32 masters (bf16/fp16), Adam moments."""
    resident_blocks: int
    """K: blocks kept on the device with a device AdamW (``--resident-blocks``)."""
    resident_blocks_bytes: int
    """Those K blocks on the device: parameters, gradients, fp32 masters and AdamW moments."""
    device_peak_bytes: int
    """Peak device bytes measured (CUDA: max_memory_allocated, activations included; CPU: window
    arena + head/tail, activations are ordinary host allocations there)."""
    resident_bytes: int
    """What training every block on the device would need: all parameters, gradients, masters and
    Adam moments (activations not counted)."""
    host_tiers: dict[str, int] = field(default_factory=dict)
    """Host store bytes per tier (master, exp_avg, exp_avg_sq, grad, shadow; cache: the NVMe
    tier's staging cache)."""
    disk: str | None = None
    """Where the NVMe tier is and what it holds (None without one)."""
    saved_inputs: dict | None = None
    """The last training pass's saved block inputs under input offload or the relay's staging
    (``device_bytes`` kept, ``staged_bytes`` copied to host memory; ``Engine.stats``), or None."""

    def lines(self) -> list[str]:
        planned = self.window_bytes + self.resident_blocks_bytes + self.head_tail_bytes
        resident = (f" + {self.resident_blocks} resident blocks {format_bytes(self.resident_blocks_bytes)}"
                    if self.resident_blocks else "")
        out = [f"device: window W={self.window} of {self.blocks} blocks {format_bytes(self.window_bytes)}"
               f"{resident} + head/tail {format_bytes(self.head_tail_bytes)} = {format_bytes(planned)}; "
               f"measured peak {format_bytes(self.device_peak_bytes)}",
               f"resident model would need {format_bytes(self.resident_bytes)} on the device "
               f"({self.resident_bytes / max(1, planned):.1f}x this run's)",
               "host store: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.host_tiers.items())
               + f" (total {format_bytes(sum(self.host_tiers.values()))})"]
        if self.saved_inputs is not None:
            disk = self.saved_inputs.get("disk_bytes", 0)
            out.append(f"saved block inputs per pass: {format_bytes(self.saved_inputs['device_bytes'])} on the "
                       f"device, {format_bytes(self.saved_inputs['staged_bytes'])} offloaded to host memory"
                       + (f", {format_bytes(disk)} of them on to the NVMe tier" if disk else ""))
        if self.disk is not None:
            out.append(f"NVMe tier: {self.disk}")
        return out


def device_peak_bytes(engine, memory=None) -> int:
    """Peak device bytes of ``engine``: CUDA's allocator peak, or on CPU the arena + head/tail and
    resident-block state (``memory``: its ``memory_report()``, taken when None)."""
    if engine.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(engine.device))
    memory = memory or engine.memory_report()
    return memory.device_arena_used_bytes + memory.device_head_tail_bytes + memory.device_resident_blocks_bytes


def memory_report(engine) -> MemoryReport:
    """The ``MemoryReport`` of a wrapped model."""
    per = device_bytes_per_param(engine.dtype, master_grads=False)  # param + grad + 2 moments (+ master)
    memory = engine.memory_report()
    disk = None
    st = memory.disk
    if st is not None:
        disk = (f"{st['directory']}: {memory.disk_placement}; files "
                f"{format_bytes(st['file_bytes'])}, read {format_bytes(st['read_bytes'])}, written "
                f"{format_bytes(st['write_bytes'])}, cache hits {st['hits']} / misses {st['misses']}")
    return MemoryReport(window=memory.window_slots, blocks=memory.blocks,
                        window_bytes=memory.device_window_bytes, head_tail_bytes=memory.device_head_tail_bytes,
                        resident_blocks=memory.resident_blocks,
                        resident_blocks_bytes=memory.device_resident_blocks_bytes,
                        device_peak_bytes=device_peak_bytes(engine, memory),
                        resident_bytes=(sum(memory.streamed_block_elements) + memory.device_elements) * per,
                        host_tiers=dict(memory.host_tier_bytes), disk=disk,
                        saved_inputs=engine.stats()["saved_inputs"])


@dataclass(slots=True)
class TimeReport:
    """Where time went over the run: seconds per trace kind (summed over intervals), and wall time."""

    wall_s: float = 0.0
    """Wall seconds of the training steps (evaluation and checkpoints excluded)."""
    kind_s: dict[str, float] = field(default_factory=dict)
    """Seconds per event kind (compute_fwd, compute_bwd, recompute, h2d, d2h, optimizer, wait, ...);
    background kinds run concurrently with compute, so they do not add up to the wall time."""
    eval_s: float = 0.0
    """Wall seconds of validation."""
    checkpoint_s: float = 0.0
    """Wall seconds of checkpoint writes."""
    hidden_s: float = 0.0
    """Seconds of background work (transfers, host updates) that overlapped compute."""
    background_s: float = 0.0
    """Seconds of background work (union per interval)."""

    def add(self, summary) -> None:
        for k, v in summary.time_s.items():
            self.kind_s[k] = self.kind_s.get(k, 0.0) + v
        if summary.overlap_fraction is not None:
            bg = sum(summary.busy_s.get(lane, 0.0) for lane in ("h2d", "d2h", "optimizer", "file_io"))
            self.background_s += bg
            self.hidden_s += bg * summary.overlap_fraction

    def lines(self) -> list[str]:
        compute = sum(self.kind_s.get(k, 0.0) for k in ("compute_fwd", "compute_bwd", "recompute"))
        out = [f"wall {self.wall_s:.1f} s training, {self.eval_s:.1f} s validation, "
               f"{self.checkpoint_s:.1f} s checkpoints",
               f"compute {compute:.1f} s (fwd {self.kind_s.get('compute_fwd', 0):.1f}, bwd "
               f"{self.kind_s.get('compute_bwd', 0):.1f}, recompute {self.kind_s.get('recompute', 0):.1f}); "
               f"waiting for copies/updates {self.kind_s.get('wait', 0):.1f} s",
               f"background: h2d {self.kind_s.get('h2d', 0):.1f} s, d2h {self.kind_s.get('d2h', 0):.1f} s, "
               f"host Adam {self.kind_s.get('optimizer', 0):.1f} s, norms {self.kind_s.get('norm', 0):.1f} s"
               + (f", disk read {self.kind_s['file_read']:.1f} s, disk write {self.kind_s.get('file_write', 0):.1f} s"
                  if "file_read" in self.kind_s else "")
               + (f"; over the whole run {100 * self.hidden_s / self.background_s:.0f}% of this background "
                  "work was hidden behind compute" if self.background_s else "")]
        p = self.parts()
        out.append(f"outside the blocks' compute: model {p['model']:.1f} s (head, tail, loss, resident "
                   f"blocks, glue between blocks), engine per-block calls {p['engine']:.1f} s (waits "
                   f"included), optimizer step {p['step']:.1f} s (exposed host updates, device AdamW), "
                   f"unaccounted {p['unaccounted']:.1f} s (training loop, data, Python outside the engine)")
        return out

    def parts(self) -> dict[str, float]:
        """The training wall time split into named parts, seconds: ``compute`` (block forward,
        backward, recompute), ``model``, ``engine`` and ``step`` (host spans, ``runtime/tracing/host_time.py``;
        the waits for copies and host updates are inside ``engine``), and ``unaccounted``, the wall
        time none of them covers. On the CPU backend the parts are disjoint host time and sum to
        ``wall_s``; on CUDA compute is device time that overlaps the host's, so ``unaccounted`` can be
        negative (it is reported as it is, never clamped)."""
        named = {"compute": sum(self.kind_s.get(k, 0.0) for k in ("compute_fwd", "compute_bwd", "recompute")),
                 **{k: self.kind_s.get(k, 0.0) for k in HOST_KINDS}}
        return {**named, "unaccounted": self.wall_s - sum(named.values())}


@dataclass(slots=True)
class TrainResult:
    """What a run produced."""

    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, training loss) of every step run in this process (1-based steps)."""
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss) of every evaluation."""
    intervals: list[IntervalMetrics] = field(default_factory=list)
    """One entry per metrics line."""
    memory: MemoryReport | None = None
    time: TimeReport = field(default_factory=TimeReport)
    start_step: int = 0
    """Steps already done when this process started (a resumed run's checkpoint step)."""
    checkpoints: list[str] = field(default_factory=list)
    """Directories of the checkpoints written and still there (not deleted by ``--keep``)."""
    outputs: list[str] = field(default_factory=list)
    """Trace files and pictures written."""
    stopped_by: str | None = None
    """Name of the signal (e.g. "SIGINT") that stopped the run after a step; None: it ran to the end."""
    skipped_steps: int = 0
    """fp16 steps of this process skipped for inf/NaN gradients (their losses are in ``losses``)."""

    def summary_lines(self) -> list[str]:
        out = []
        if self.losses:
            out.append(f"trained steps {self.start_step + 1}..{self.losses[-1][0]}: loss "
                       f"{self.losses[0][1]:.4f} -> {self.losses[-1][1]:.4f}"
                       + (f", validation {self.val_losses[-1][1]:.4f}" if self.val_losses else "")
                       + (f"; {self.skipped_steps} skipped (fp16 inf/NaN gradients)" if self.skipped_steps else ""))
            if self.time.wall_s > 0:
                out.append(f"tokens/s {format_rate(self.intervals[-1].tokens_per_s)} (last interval), "
                           f"ms/step {1e3 * self.time.wall_s / len(self.losses):.1f} (mean)")
        if self.memory is not None:
            out += ["memory:"] + ["  " + s for s in self.memory.lines()]
        out += ["time:"] + ["  " + s for s in self.time.lines()]
        out += [f"wrote {p}" for p in self.checkpoints + self.outputs]
        return out
