"""`pystronghold train --offload-activations`: the saved block inputs go to host memory and the run
is the one that keeps them on the device."""

from __future__ import annotations

import dataclasses

from pystronghold.train.loop import Trainer
from pystronghold.train.run import resolve
from pystronghold.train.metrics import memory_report
from train_helpers import TINY, tiny_config


def _run(config):
    trainer = Trainer(resolve(config))
    try:
        result = trainer.train()
        return result, trainer.engine.stats()["saved_inputs"], memory_report(trainer.engine).lines()
    finally:
        trainer.close()


def test_offloaded_run_equals_the_kept_one(tmp_path):
    """fp32, clipping, accumulation 2: the same losses bit for bit; the last pass staged every
    block's input, (batch, seq, hidden) fp32 each."""
    config = tiny_config(tmp_path, steps=3, accumulation=2)
    kept, none, _ = _run(config)
    offloaded, staged, report = _run(dataclasses.replace(
        config, runtime=dataclasses.replace(config.runtime, offload_block_inputs=True)))
    assert offloaded.losses == kept.losses and none is None
    assert staged == dict(device_bytes=0, staged_bytes=TINY["layers"] * 4 * 32 * TINY["hidden"] * 4, disk_bytes=0)
    assert "saved block inputs per pass: 0 B on the device, 64.0 KiB offloaded to host memory" in report
