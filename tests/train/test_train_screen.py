"""What `pystronghold train` shows on the screen: the memory report's sum, the progress bar beside
the log lines, and which loss each line gives."""

from __future__ import annotations

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
