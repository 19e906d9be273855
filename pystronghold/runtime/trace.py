"""Timeline of the runtime's actions: record, export as Chrome-trace JSON, summarise.

Each action (compute, copy, optimizer update, stall) is one event with a kind, a block, start
and end times in host seconds (``time.monotonic()``) and the bytes it moved. Events are grouped
into lanes (compute, h2d, d2h, optimizer, file_io, stall, host) for display and busy-time
accounting; an unknown kind gets a lane of its own name. Host-timed actions are recorded at once
(``record``); device-timed ones are held by ``defer`` and placed on the host clock by ``resolve``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pystronghold.runtime.tracing.timing import Calibration, is_host_mark, mark_done, to_host_s

__all__ = ["Tracer", "TraceEvent", "TraceSummary", "COMPUTE_KINDS", "BACKGROUND_KINDS",
           "TRANSFER_KINDS", "LANE_OF_KIND", "lanes_of"]

COMPUTE_KINDS = frozenset({"compute_fwd", "compute_bwd", "recompute"})
"""Kinds that are accelerator compute."""
TRANSFER_KINDS = frozenset({"h2d", "d2h", "act_d2h", "act_h2d", "file_read", "file_write"})
"""Kinds that move bytes; each gets a bandwidth in the summary. ``act_d2h``/``act_h2d``: saved block
inputs offloaded to host memory and brought back (``saved_inputs.py``)."""
BACKGROUND_KINDS = TRANSFER_KINDS | {"optimizer", "norm"}
"""Kinds the runtime tries to hide behind compute (the numerator set of the overlap fraction)."""
LANE_OF_KIND = {
    "compute_fwd": "compute", "compute_bwd": "compute", "recompute": "compute",
    "h2d": "h2d", "d2h": "d2h", "act_h2d": "h2d", "act_d2h": "d2h", "optimizer": "optimizer", "norm": "optimizer",
    "file_read": "file_io", "file_write": "file_io", "wait": "stall",
    "model": "host", "engine": "host", "step": "host",
}
"""Default lane of each known kind."""
_LANE_ORDER = ("compute", "h2d", "d2h", "optimizer", "file_io", "stall", "host")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One recorded action."""

    kind: str
    """What happened, e.g. "h2d" (see the module docstring)."""
    block: int | None
    """Index of the block it concerns; None for head/tail or whole-step actions."""
    start_s: float
    """Start, seconds on the ``time.monotonic()`` clock."""
    end_s: float
    """End, seconds on the same clock (>= start_s)."""
    nbytes: int
    """Bytes moved (0 for compute and waits)."""
    lane: str
    """Display row and busy-time group."""

    @property
    def duration_s(self) -> float:
        """end_s - start_s, in seconds."""
        return self.end_s - self.start_s


@dataclass(slots=True)
class TraceSummary:
    """What a trace says about a run. Times in seconds, bandwidth in GB/s (1 GB = 1e9 bytes)."""

    events: int
    """Number of events summarised."""
    wall_s: float
    """From the earliest start to the latest end of all events."""
    busy_s: dict[str, float] = field(default_factory=dict)
    """Per lane: length of the union of its events' intervals (concurrent events counted once)."""
    time_s: dict[str, float] = field(default_factory=dict)
    """Per kind: sum of event durations (concurrent events each counted)."""
    overlap_fraction: float | None = None
    """Fraction of background time that ran while compute ran: with X the union of the intervals of
    the background kinds (TRANSFER_KINDS, optimizer, norm) and K the union of the
    compute intervals (compute_fwd, compute_bwd, recompute), overlap = |X intersect K| / |X|. 1.0 means
    every transfer and host update was hidden behind compute. None when there is no background
    time (nothing to hide)."""
    stall_s: float = 0.0
    """Sum of the durations of "wait" events: time compute sat waiting for data."""
    bytes: dict[str, int] = field(default_factory=dict)
    """Per transfer kind present (``TRANSFER_KINDS``): total bytes moved."""
    gbps: dict[str, float] = field(default_factory=dict)
    """Per transfer kind: bytes / (union of that kind's intervals) / 1e9, i.e. the achieved
    bandwidth while that kind of copy was in flight (concurrent copies share the time)."""

    def line(self) -> str:
        """One-line human summary, e.g. for a training log."""
        overlap = "-" if self.overlap_fraction is None else f"{100 * self.overlap_fraction:.1f}%"
        rates = " ".join(f"{k}={v:.2f}GB/s" for k, v in sorted(self.gbps.items()))
        return (f"wall={self.wall_s * 1e3:.2f}ms overlap={overlap} stall={self.stall_s * 1e3:.2f}ms "
                f"{rates}").rstrip()


class Tracer:
    """Thread-safe recorder of runtime events.

    ``enabled=False`` makes ``record`` and ``span`` do nothing (not even the profiler range), so
    the runtime can leave its calls in place at no cost.
    """

    def __init__(self, enabled: bool = True, block_offset: int = 0) -> None:
        self.enabled = enabled
        self.block_offset = block_offset
        """Added to every block index recorded: the engine numbers its streamed blocks from 0, and
        with K device-resident blocks the first streamed block is model block K."""
        self._events: list[TraceEvent] = []
        self._pending: list[tuple] = []  # (kind, block, start mark, end mark, nbytes, lane)
        self._lock = threading.Lock()

    # ---- recording

    def record(self, kind: str, block: int | None, start_s: float, end_s: float,
               nbytes: int = 0, lane: str | None = None) -> None:
        """Record an action that ran from ``start_s`` to ``end_s`` (seconds, ``time.monotonic()``).

        ``nbytes`` is the bytes it moved; ``lane`` overrides the default lane of ``kind``.
        Raises ValueError for an empty kind, end before start, or negative bytes.
        """
        if not self.enabled:
            return
        if not kind:
            raise ValueError("Tracer.record: kind must be a non-empty string")
        if end_s < start_s:
            raise ValueError(f"Tracer.record: end_s={end_s} is before start_s={start_s} ({kind})")
        if nbytes < 0:
            raise ValueError(f"Tracer.record: nbytes must be >= 0, got {nbytes} ({kind})")
        block = None if block is None else block + self.block_offset
        event = TraceEvent(kind, block, float(start_s), float(end_s), int(nbytes),
                           lane or LANE_OF_KIND.get(kind, kind))
        with self._lock:
            self._events.append(event)

    def defer(self, kind: str, block: int | None, start, end, nbytes: int = 0,
              lane: str | None = None) -> None:
        """Record an action timed by two marks (``pystronghold.runtime.tracing.timing``): host readings
        (float seconds) are recorded at once; device events wait for ``resolve``."""
        if not self.enabled:
            return
        if is_host_mark(start) and is_host_mark(end):
            self.record(kind, block, start, end, nbytes, lane)
            return
        with self._lock:
            self._pending.append((kind, block, start, end, nbytes, lane))

    def resolve(self, calibrate: Callable[[], Calibration | None]) -> int:
        """Record the deferred actions whose marks have all happened, placed on the host clock by
        one ``calibrate()`` taken after checking them (so it follows every mark it places); the
        others stay deferred. Returns how many were recorded."""
        with self._lock:
            ready, waiting = [], []
            for p in self._pending:
                (ready if mark_done(p[2]) and mark_done(p[3]) else waiting).append(p)
            if not ready:
                return 0
            self._pending = waiting
        calibration = calibrate()
        for kind, block, start, end, nbytes, lane in ready:
            start_s = to_host_s(start, calibration)
            self.record(kind, block, start_s, max(to_host_s(end, calibration), start_s), nbytes, lane)
        return len(ready)

    def pending(self) -> int:
        """Deferred actions not resolved yet."""
        with self._lock:
            return len(self._pending)

    @contextlib.contextmanager
    def span(self, kind: str, block: int | None = None, nbytes: int = 0,
             lane: str | None = None, clock=None) -> Iterator[None]:
        """Time the ``with`` body as one event; also a ``torch.profiler.record_function`` range.

        ``clock`` (a ``timing.HostClock`` or ``timing.EventClock``) makes the marks; by default
        the host clock (work the host itself does). With an ``EventClock`` the span is the time the
        device's stream took over the work issued in the body, resolved later (``resolve``).
        """
        if not self.enabled:
            yield
            return
        label = f"pystronghold::{kind}" + ("" if block is None else f"[{block + self.block_offset}]")
        with torch.profiler.record_function(label):
            start = time.monotonic() if clock is None else clock.mark()
            try:
                yield
            finally:
                end = time.monotonic() if clock is None else clock.mark()
                self.defer(kind, block, start, end, nbytes, lane)

    def events(self) -> list[TraceEvent]:
        """A copy of the events recorded so far, in recording order."""
        with self._lock:
            return list(self._events)

    def clear(self) -> None:
        """Forget the events recorded so far. Deferred ones (device marks not resolved yet) are
        kept: a span still running on the device at a log point is recorded once it resolves."""
        with self._lock:
            self._events.clear()

    # ---- export

    def write_chrome_json(self, path: str | os.PathLike) -> Path:
        """Write the events as Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing).

        One row (tid) per lane in a fixed order (compute, h2d, d2h, optimizer, file_io, stall, host, then
        any others); timestamps in microseconds from the first event. Returns the path written.
        """
        events = self.events()
        t0 = min((e.start_s for e in events), default=0.0)
        lanes = lanes_of(events)
        tid = {lane: i for i, lane in enumerate(lanes)}
        pid = os.getpid()
        out: list[dict] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                            "args": {"name": "pystronghold"}}]
        for lane, i in tid.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": i, "args": {"name": lane}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": i,
                        "args": {"sort_index": i}})
        for e in events:
            out.append({
                "ph": "X", "pid": pid, "tid": tid[e.lane], "cat": e.kind,
                "name": e.kind if e.block is None else f"{e.kind} {e.block}",
                "ts": (e.start_s - t0) * 1e6, "dur": e.duration_s * 1e6,
                "args": {"block": e.block, "bytes": e.nbytes},
            })
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
        return path

    def write_png(self, path: str | os.PathLike, *, title: str | None = None,
                  steps: list[tuple[int, float]] | None = None, min_event_width: float = 1 / 400) -> Path:
        """Draw the timeline as a PNG (one row per lane, milliseconds, a dashed line at each of ``steps``'
        ``(step number, start seconds)``); returns the path written.

        Events are at least ``min_event_width`` of the span wide so short copies stay visible; stalls
        keep their true width. Needs matplotlib (``pip install pystronghold[plots]``), else ImportError.
        """
        from pystronghold.extras import require

        require("plots", "Tracer.write_png")
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        events = self.events()
        t0 = min((e.start_s for e in events), default=0.0)
        span_ms = max((e.end_s for e in events), default=t0) * 1e3 - t0 * 1e3
        lanes = lanes_of(events)
        colors = plt.get_cmap("tab10")
        fig, ax = plt.subplots(figsize=(12, 0.6 * max(len(lanes), 1) + 1.4))
        for row, lane in enumerate(lanes):
            mine = [e for e in events if e.lane == lane]
            least_ms = 0.0 if lane == "stall" else span_ms * min_event_width
            spans = [((e.start_s - t0) * 1e3, max(e.duration_s * 1e3, least_ms)) for e in mine]
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=colors(row % 10), edgecolors=colors(row % 10),
                           linewidth=0.6, alpha=0.85)
            busy = sum(e.duration_s for e in mine) * 1e3
            ax.text(span_ms * 1.005, row, f"{len(mine)} events, {busy:.1f} ms", va="center", fontsize=8)
            for e, (x, width) in zip(mine, spans):
                if lane == "compute" and e.block is not None and width >= span_ms / 80:
                    ax.text(x + width / 2, row, str(e.block), ha="center", va="center", fontsize=6)
        for step, start in steps or ():
            x = (start - t0) * 1e3
            ax.axvline(x, color="0.3", linestyle="--", linewidth=0.8)
            ax.text(x, -0.6, f" step {step}", fontsize=7, va="bottom")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.invert_yaxis()
        ax.set_xlim(0, span_ms * 1.14 if span_ms > 0 else 1)
        ax.set_xlabel("time (ms)")
        ax.set_title(title if title is not None else self.summary().line(), fontsize=9)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    # ---- summary

    def summary(self) -> TraceSummary:
        """Wall time, busy time per lane, overlap fraction, stall time and bandwidths (see TraceSummary)."""
        events = self.events()
        if not events:
            return TraceSummary(events=0, wall_s=0.0)
        wall = max(e.end_s for e in events) - min(e.start_s for e in events)
        busy = {lane: _length(_union([e for e in events if e.lane == lane]))
                for lane in {e.lane for e in events}}
        time_s: dict[str, float] = {}
        for e in events:
            time_s[e.kind] = time_s.get(e.kind, 0.0) + e.duration_s
        background = _union([e for e in events if e.kind in BACKGROUND_KINDS])
        compute = _union([e for e in events if e.kind in COMPUTE_KINDS])
        hidden = _length(background)
        overlap = _length(_intersect(background, compute)) / hidden if hidden > 0 else None
        nbytes: dict[str, int] = {}
        gbps: dict[str, float] = {}
        for kind in sorted(TRANSFER_KINDS):
            mine = [e for e in events if e.kind == kind]
            if not mine:
                continue
            nbytes[kind] = sum(e.nbytes for e in mine)
            span = _length(_union(mine))
            gbps[kind] = nbytes[kind] / span / 1e9 if span > 0 else 0.0
        return TraceSummary(events=len(events), wall_s=wall, busy_s=busy, time_s=time_s,
                            overlap_fraction=overlap, stall_s=time_s.get("wait", 0.0),
                            bytes=nbytes, gbps=gbps)


def lanes_of(events: list[TraceEvent]) -> list[str]:
    """Lanes present, the known ones in display order first, then the others by name."""
    lanes = [lane for lane in _LANE_ORDER if any(e.lane == lane for e in events)]
    return lanes + sorted({e.lane for e in events} - set(lanes))


# ---- interval arithmetic (lists of disjoint, sorted [start, end) pairs)

def _union(events: list[TraceEvent]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted((e.start_s, e.end_s) for e in events):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)
