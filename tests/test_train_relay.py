"""`pystronghold train --schedule relay`: the same run as the default schedule, checkpoints included."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from pystronghold.cli import main
from pystronghold.train.loop import Trainer
from train_helpers import tiny_config


def _run(config):
    trainer = Trainer(config)
    try:
        return trainer.train(), trainer.engine.stats()
    finally:
        trainer.close()


def _relay(config):
    return dataclasses.replace(config, optim=dataclasses.replace(config.optim, schedule="relay"))


def test_relay_run_equals_default_and_its_checkpoints_resume_with_either(tmp_path):
    """fp32, clipping, accumulation 3: relay losses equal the default's (the same arithmetic); a
    relay checkpoint resumed with the default schedule reproduces the straight run (one format)."""
    straight, _ = _run(tiny_config(tmp_path, steps=4, accumulation=3))
    relay, stats = _run(_relay(tiny_config(tmp_path, steps=4, accumulation=3)))
    assert relay.losses == straight.losses
    assert stats["steps"] == 4
    ck = tmp_path / "ck"
    _run(_relay(tiny_config(tmp_path, steps=4, accumulation=3, ckpt=str(ck), every=2)))
    shutil.rmtree(ck / "step-00000004")
    resumed, _ = _run(tiny_config(tmp_path, steps=4, accumulation=3, ckpt=str(ck), resume=True))
    assert resumed.losses == straight.losses[2:]


def test_schedule_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--schedule", "layer-major"])
    assert exc.value.code == 2
    assert "--schedule" in capsys.readouterr().err


def test_schedule_auto_picks_relay_with_accumulation(tmp_path):
    from pystronghold.train.config import OptimOptions

    assert OptimOptions(accumulation=4, schedule="auto").schedule_value == "relay"
    assert OptimOptions(accumulation=1, schedule="auto").schedule_value == "default"
    assert OptimOptions(accumulation=4, schedule="default").schedule_value == "default"
