"""The files ``--trace DIR`` writes: trace.json (Chrome trace / Perfetto), timeline.png (one lane
each for compute, H2D, D2H, optimizer, file I/O, stall) and loss.png (training and validation loss)."""

from __future__ import annotations

import bisect
from pathlib import Path

from pystronghold.runtime.trace import Tracer, lanes_of

__all__ = ["write_outputs", "write_loss_png", "write_timeline_png", "step_starts", "timeline_title"]

MIN_EVENT_WIDTH = 1 / 400
"""Narrowest bar of the timeline, as a fraction of its time span (a block's copy takes microseconds
next to steps of hundreds of milliseconds; drawn to scale it would vanish)."""


def step_starts(events, steps: list[int]) -> list[tuple[int, float]]:
    """``(step number, start in seconds)`` of the steps in ``events``, oldest first. ``steps``: the
    numbers of the last steps run, oldest first (matched from the end).

    A step ends with its optimizer step (the host span of kind "step", ``Engine.run_step``) and
    starts with the first host span after the previous one's end (for the trace's first step, its
    first host span). NOTE: not the forward of block 0: a device-resident block 0 is not traced, and
    gradient accumulation runs several forwards per step."""
    step_ends = sorted(e.end_s for e in events if e.kind == "step")
    host = sorted(e.start_s for e in events if e.lane == "host")  # the "step" spans among them
    starts, previous_end = [], float("-inf")
    for end in step_ends:
        starts.append(host[bisect.bisect_left(host, previous_end)])
        previous_end = end
    starts = starts[len(starts) - min(len(starts), len(steps)):]
    return list(zip(steps[len(steps) - len(starts):], starts))


def timeline_title(n_steps: int, window, summary) -> str:
    """The timeline's title. Its figure is for the pictured steps only, named so that it is not
    read as the run summary's whole-run "background work hidden behind compute"."""
    hidden = "-" if summary.overlap_fraction is None else f"{100 * summary.overlap_fraction:.0f}%"
    shown = f"last {n_steps} steps" if n_steps else "the whole trace"
    return (f"{shown}, W={window}: in these steps {hidden} of copy and host-update time "
            f"overlapped compute; compute stalled {summary.stall_s * 1e3:.1f} ms waiting")


def write_timeline_png(path: Path, tracer: Tracer, title: str,
                       steps: list[tuple[int, float]] | None = None) -> Path:
    """One row per lane (compute, h2d, d2h, optimizer, file_io, stall), milliseconds from the first
    event, a dashed line where each of ``steps`` (``step_starts``) begins, and block numbers on the
    compute bars wide enough to hold them. NOTE: unlike ``Tracer.write_png``, every event but a stall is
    drawn at least ``MIN_EVENT_WIDTH`` of the span wide, with an edge, so copies stay visible.
    Stalls keep their true width: on CUDA every compute-waits-for-copy is a span, most of them zero
    long (the copy had finished), and widening them would draw stalls that did not happen."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    events = tracer.events()
    t0 = min((e.start_s for e in events), default=0.0)
    span_ms = max((e.end_s for e in events), default=t0) * 1e3 - t0 * 1e3
    lanes = lanes_of(events)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 0.6 * max(len(lanes), 1) + 1.4))
    for row, lane in enumerate(lanes):
        mine = [e for e in events if e.lane == lane]
        least_ms = 0.0 if lane == "stall" else span_ms * MIN_EVENT_WIDTH
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
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_loss_png(path: Path, losses: list[tuple[int, float]], val_losses: list[tuple[int, float]],
                   title: str = "loss") -> Path:
    """Plot training (per step) and validation losses (nats/byte) against the step; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if losses:
        ax.plot(*zip(*losses), lw=1, label="training")
    if val_losses:
        ax.plot(*zip(*val_losses), "o-", lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(out: Path, events, result, max_png_steps: int = 3) -> list[Path]:
    """Write trace.json of every event, timeline.png of the last ``max_png_steps`` steps' events
    (a whole run is too dense to read) and loss.png. Returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    full = Tracer(enabled=True)
    for e in events:
        full.record(e.kind, e.block, e.start_s, e.end_s, e.nbytes, e.lane)
    paths = [full.write_chrome_json(out / "trace.json")]
    shown = step_starts(events, [k for k, _ in result.losses])[-max_png_steps:]
    cut = shown[0][1] if shown else float("-inf")
    tail = Tracer(enabled=True)
    for e in events:
        if e.start_s >= cut:
            tail.record(e.kind, e.block, e.start_s, e.end_s, e.nbytes, e.lane)
    window = result.memory.window if result.memory else "?"
    paths.append(write_timeline_png(out / "timeline.png", tail,
                                    timeline_title(len(shown), window, tail.summary()), steps=shown))
    paths.append(write_loss_png(out / "loss.png", result.losses, result.val_losses))
    return paths
