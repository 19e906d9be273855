"""The files ``--trace DIR`` writes: trace.json (Chrome trace / Perfetto), timeline.png (one lane
each for compute, H2D, D2H, optimizer, file I/O, stall) and loss.png (training and validation loss)."""

from __future__ import annotations

from pathlib import Path

from pystronghold.trace import Tracer

__all__ = ["write_outputs", "write_loss_png"]


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
    # the last steps: events after the (max_png_steps + 1)-th last forward of block 0
    starts = sorted(e.start_s for e in events if e.kind == "compute_fwd" and e.block == 0)
    cut = starts[-max_png_steps] if len(starts) >= max_png_steps else float("-inf")
    tail = Tracer(enabled=True)
    for e in events:
        if e.start_s >= cut:
            tail.record(e.kind, e.block, e.start_s, e.end_s, e.nbytes, e.lane)
    s = tail.summary()
    overlap = "-" if s.overlap_fraction is None else f"{100 * s.overlap_fraction:.0f}%"
    paths.append(tail.write_png(out / "timeline.png", title=f"last {min(max_png_steps, len(starts))} "
                                f"steps (W={result.memory.window if result.memory else '?'}), "
                                f"overlap {overlap}"))
    paths.append(write_loss_png(out / "loss.png", result.losses, result.val_losses))
    return paths
