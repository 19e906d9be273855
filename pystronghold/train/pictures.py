"""The files ``--trace DIR`` writes: trace.json (Chrome trace / Perfetto), timeline.png (one lane
each for compute, H2D, D2H, optimizer, file I/O, stall) and loss.png (training and validation loss)."""

from __future__ import annotations

import bisect
from pathlib import Path

from pystronghold.runtime.tracing.trace import Tracer
from pystronghold.train.metrics import OutputWriteError

__all__ = ["write_outputs", "write_loss_png", "loss_axis_label", "step_starts", "timeline_title"]


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


def loss_axis_label(unit: str) -> str:
    """The loss axis's label for a stream of ``unit`` ("byte" or "token", ``data.Corpus.unit``)."""
    if unit not in ("byte", "token"):
        raise ValueError(f"loss_axis_label: unit must be 'byte' or 'token', got {unit!r}")
    return f"cross-entropy (nats/{unit})"


def write_loss_png(path: Path, losses: list[tuple[int, float]], val_losses: list[tuple[int, float]],
                   title: str = "loss", unit: str = "byte") -> Path:
    """Plot training (per step) and validation losses (nats per ``unit``, "byte" or "token") against
    the step; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if losses:
        ax.plot(*zip(*losses), lw=1, label="training")
    if val_losses:
        ax.plot(*zip(*val_losses), "o-", lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel(loss_axis_label(unit))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(out: Path, events, result, max_png_steps: int = 3, unit: str = "byte") -> list[Path]:
    """Write trace.json of every event, timeline.png of the last ``max_png_steps`` steps' events
    (a whole run is too dense to read) and loss.png (losses in nats per ``unit``). Returns the paths;
    ``OutputWriteError`` naming --trace and ``out`` when a write fails."""
    try:
        return _write_outputs(out, events, result, max_png_steps, unit)
    except OSError as e:
        raise OutputWriteError("--trace", out, "writing the trace and pictures", e) from None


def _write_outputs(out: Path, events, result, max_png_steps: int, unit: str) -> list[Path]:
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
    paths.append(tail.write_png(out / "timeline.png", title=timeline_title(len(shown), window, tail.summary()),
                                steps=shown))
    paths.append(write_loss_png(out / "loss.png", result.losses, result.val_losses, unit=unit))
    return paths
