"""`pystronghold train --schedule relay`: the same run as the default schedule, checkpoints included."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from pystronghold.cli import main
from pystronghold.train.loop import Trainer
from pystronghold.train.run import resolve
from train_helpers import tiny_config


def _run(config):
    trainer = Trainer(resolve(config))
    try:
        return trainer.train(), trainer.engine.stats()
    finally:
        trainer.close()


def _relay(config):
    return dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, schedule="relay"))


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


def test_unknown_schedule_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--schedule", "layer-major"])
    assert exc.value.code == 2
    assert "--schedule" in capsys.readouterr().err


def test_schedule_auto_picks_relay_with_accumulation():
    from pystronghold.runtime.config import RuntimeConfig

    assert RuntimeConfig(accumulation_steps=4, schedule="auto").schedule_mode == "relay"
    assert RuntimeConfig(accumulation_steps=1, schedule="auto").schedule_mode == "default"
    assert RuntimeConfig(accumulation_steps=4, schedule="default").schedule_mode == "default"
    assert RuntimeConfig(accumulation_steps=4, schedule="relay").schedule_mode == "relay"


def test_schedule_and_layer_drop_errors_name_the_field():
    from pystronghold.options import ConfigError
    from pystronghold.runtime.config import RuntimeConfig

    with pytest.raises(ConfigError, match="RuntimeConfig.schedule"):
        RuntimeConfig(schedule="layer-major")
    with pytest.raises(ConfigError, match="RuntimeConfig.relay_activation_bytes"):
        RuntimeConfig(relay_activation_bytes=-1)
    with pytest.raises(ConfigError, match="RuntimeConfig.layer_drop"):
        RuntimeConfig(layer_drop=1.0)
    with pytest.raises(ConfigError, match="RuntimeConfig.layer_drop"):
        RuntimeConfig(layer_drop=0.5, resident_blocks=1)


def test_schedule_options_on_the_train_command_line():
    from pystronghold.cli import build_parser
    from pystronghold.train.command import config_from_args

    config = config_from_args(build_parser().parse_args(
        ["train", "--schedule", "relay", "--relay-activations", "1MiB", "--layer-drop", "0.25", "--accumulation", "4"]))
    assert (config.runtime.schedule, config.runtime.relay_activation_bytes, config.runtime.layer_drop) \
        == ("relay", 2**20, 0.25)


def test_layer_drop_checkpoint_keeps_each_blocks_step_count_and_the_draws(tmp_path):
    """--layer-drop: a block skipped in some steps has taken fewer AdamW steps; a checkpoint keeps each
    block's count and the generator of the draws, so --resume restores the counts and skips the
    blocks the uninterrupted run skipped: its later losses are that run's (fp32, the same
    operations: equal to 1e-6)."""
    import shutil

    ck = tmp_path / "ck"

    def config(steps, resume):
        c = tiny_config(tmp_path, steps=steps, ckpt=str(ck), every=4, resume=resume)
        return dataclasses.replace(c, runtime=dataclasses.replace(c.runtime, layer_drop=0.5, layer_drop_seed=3))

    trainer = Trainer(resolve(config(8, False)))
    try:
        trainer.train()
        straight = dict(trainer.result.losses)
    finally:
        trainer.close()  # checkpoints at steps 4 and 8
    shutil.rmtree(ck / "step-00000008")
    resumed = Trainer(resolve(config(8, True)))
    try:
        counts = list(resumed.engine.block_steps)
        assert resumed.engine.steps == 4 and len(set(counts)) > 1 and max(counts) <= 4
        resumed.train()
        losses = dict(resumed.result.losses)
    finally:
        resumed.close()
    assert sorted(losses) == [5, 6, 7, 8]
    assert [losses[s] for s in losses] == pytest.approx([straight[s] for s in losses], rel=1e-6)
