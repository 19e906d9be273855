"""Checkpoints save and load a dict of state objects (``state_dict``/``load_state_dict``), not a
Trainer; the on-disk format is the one written before they did."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from pystronghold.train.checkpoint_state import RunRecord
from train_helpers import run_training, save_trainer, tiny_config

SMALL = {"vocab_size": 256, "seq_len": 32, "layers": 2, "hidden": 16, "heads": 2}
WRITTEN_BEFORE = Path(__file__).parent / "checkpoint_v1" / "step-00000002"
"""Step 2 of ``tiny_config(steps=3, model=SMALL, every=1)``, as written by the code that saved the
Trainer itself (before the state objects)."""


def test_a_checkpoint_written_by_the_earlier_code_resumes_to_the_same_losses(tmp_path):
    straight = run_training(tiny_config(tmp_path, steps=3, model=SMALL))
    ck = tmp_path / "ck"
    shutil.copytree(WRITTEN_BEFORE, ck / WRITTEN_BEFORE.name)
    resumed = run_training(tiny_config(tmp_path, steps=3, model=SMALL, ckpt=str(ck), resume=True))
    assert resumed.start_step == 2
    assert resumed.losses == straight.losses[2:]


def test_the_loaded_state_written_again_is_the_same_bytes(tmp_path):
    """The format did not change: what the earlier code wrote, loaded and saved again at its step,
    gives every file byte for byte (the manifest lists their sha256)."""
    ck = tmp_path / "ck"
    shutil.copytree(WRITTEN_BEFORE, ck / WRITTEN_BEFORE.name)
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=3, model=SMALL, ckpt=str(ck), resume=True)))
    try:
        assert trainer.step == 2
        again = read_manifest(save_trainer(trainer, tmp_path / "again"))["files"]
    finally:
        trainer.close()
    before = read_manifest(WRITTEN_BEFORE)["files"]
    assert again == before


class Counter:
    """A state object of the caller's own, beside the run's."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_save_and_load_take_state_objects(tmp_path):
    """A dict of objects goes in, their state_dicts come back out into other objects: the masters
    and moments, the sampler's position, the schedule and an object the trainer does not know."""
    ck = tmp_path / "ck"
    first = Trainer(resolve(tiny_config(tmp_path, steps=4)))
    try:
        first.train_step()
        first.train_step()
        state, record = first.checkpoint_state()
        state["rng"] = Counter(7)  # any object with state_dict/load_state_dict
        assert isinstance(record, RunRecord) and record.step == 2
        written = save_checkpoint(state, ck, record)
        expected = first.engine.master_parameters()
        position = first.sampler.state_dict()
    finally:
        first.close()
    second = Trainer(resolve(tiny_config(tmp_path, steps=4)))
    try:
        state, record = second.checkpoint_state()
        state["rng"] = Counter(0)
        step, lineage = load_checkpoint(state, written, record)
        assert step == 2 and state["rng"].value == 7
        assert lineage == [*first.lineage, second.lineage[-1]]
        assert second.sampler.state_dict() == position
        assert second.scheduler.last_epoch == 2
        loaded = second.engine.master_parameters()
        assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    finally:
        second.close()
