"""What `pystronghold train` shows on the screen: the memory report's sum, the progress bar beside
the log lines, and which loss each line gives."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from pystronghold.train.command import Progress
from pystronghold.train.metrics import format_bytes
from train_helpers import run_training, tiny_config


def test_memory_line_sums_the_resident_blocks_too(tmp_path):
    """With 2 blocks resident the device sum holds them: on the CPU the measured peak is within it
    (the sum used to fall short by the resident blocks' bytes: a peak that read as an overrun)."""
    trainer = run_training(tiny_config(tmp_path, steps=2, window=1, resident=2), keep=True)
    m = trainer.result.memory
    assert m.resident_blocks == 2 and m.resident_blocks_bytes == trainer.engine.stats()["resident_bytes"] > 0
    planned = m.window_bytes + m.resident_blocks_bytes + m.head_tail_bytes
    # CPU: no activations counted; the arena's slots are planned_arena_bytes at most
    assert m.resident_blocks_bytes + m.head_tail_bytes < m.device_peak_bytes <= planned
    line = m.lines()[0]
    assert f"+ 2 resident blocks {format_bytes(m.resident_blocks_bytes)} +" in line, line
    assert f"= {format_bytes(planned)}; measured peak {format_bytes(m.device_peak_bytes)}" in line, line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_beside_the_progress_bar_start_on_a_line_of_their_own(monkeypatch, caplog):
    """On a terminal a metrics line logged while the bar is drawn used to follow the bar's text on
    its line; through tqdm.write the bar is cleared first (a carriage return) and redrawn after."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    caplog.set_level(logging.INFO)
    console = logging.StreamHandler(sys.stdout)  # as run_train's logging.basicConfig(stream=sys.stdout)
    logging.root.addHandler(console)
    try:
        progress = Progress(4, 0, terminal)
        progress.update(1, 5.0)
        logging.getLogger("pystronghold.train").info("step 1 | loss 5.0000")
        progress.update(2, 4.0)
        progress.close()
        assert console in logging.root.handlers  # the console handler is back after the bar
    finally:
        logging.root.removeHandler(console)
    text = terminal.getvalue()
    at = text.index("step 1 | loss 5.0000")
    assert "train:" in text[:at] and text[at - 1] == "\r" and text[at + 20] == "\n", repr(text)


def test_each_loss_on_the_screen_says_which_it_is(tmp_path, capsys):
    """The metrics line's loss is a mean over its interval, the progress line's one step's: both say
    so (they used to read "loss" alike, with different values for the same step)."""
    result = run_training(tiny_config(tmp_path, steps=4))  # --log-every 2
    m = result.intervals[-1]
    assert m.loss_steps == 2 and m.loss == pytest.approx((result.losses[-2][1] + result.losses[-1][1]) / 2)
    assert f"| loss {m.loss:.4f} (mean of 2 steps) |" in m.line()
    progress = Progress(4, 3, io.StringIO())  # not a terminal: plain lines
    progress.update(4, result.losses[-1][1])
    assert f"this step's loss {result.losses[-1][1]:.3f}" in progress.stream.getvalue()


def test_a_slow_run_prints_its_tokens_per_second_not_zero():
    """A 31.5 B model on this machine trains 0.37 tokens/s: the log line shows 0.37, not 0."""
    from pystronghold.train.metrics import IntervalMetrics

    line = IntervalMetrics(step=3, loss=10.5, loss_steps=1, ms_per_step=86281.1, tokens_per_s=32 / 86.2811,
                           h2d_gbps=None, d2h_gbps=None, device_peak_bytes=0, host_bytes=0, overlap=None,
                           skipped_steps=0).line()
    assert "| tok/s 0.371 |" in line, line
    assert "| tok/s 2484 |" in IntervalMetrics(step=1, loss=1.0, loss_steps=1, ms_per_step=1.0, tokens_per_s=2484.4,
                                                h2d_gbps=None, d2h_gbps=None, device_peak_bytes=0, host_bytes=0,
                                                overlap=None, skipped_steps=0).line()
