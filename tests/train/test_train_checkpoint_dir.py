"""The checkpoint directory's rules (train/checkpoint_dir.py): a fresh run refuses a directory with
checkpoints (--overwrite replaces them), one run per directory (a lock), pruning only of this
lineage's checkpoints, damaged checkpoints (files or manifest) moved aside and fallen back from, a
full disk named, and another model's checkpoint refused in one line."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket

import pytest

from pystronghold.cli import main
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint import CheckpointError, read_manifest
from pystronghold.train.checkpoint_dir import latest_checkpoint, newest_valid_checkpoint
from train_helpers import TINY, listing, run_training, tiny_config


def _config(tmp_path, ck, *, keep: int = 2, overwrite: bool = False, **kw):
    config = tiny_config(tmp_path, ckpt=str(ck), **kw)
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, keep=keep,
                                                                      overwrite=overwrite))


def _train_cli(tmp_path, *extra: str) -> list[str]:
    tiny_config(tmp_path)  # writes model.json and the text
    return ["train", "--model", str(tmp_path / "model.json"), "--data", str(tmp_path / "text"), "--max-bytes",
            "65536", "--batch", "4", "--seq", "32", "--window", "2", "--eval-every", "0", "--quiet", *extra]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _names(ck) -> list[str]:
    return listing(ck)


def _writer(path) -> str:
    return read_manifest(path, verify=False)["lineage"][-1]


def test_a_fresh_run_refuses_a_directory_with_checkpoints_and_overwrite_replaces_them(tmp_path, capsys):
    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=4, every=2))  # step-2 and step-4 of a 4-block GPT, hidden 32
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(newest: step 4, GPT layers 4, "
                                              r"hidden 32.*--resume.*another --checkpoint-dir.*--overwrite"):
        Trainer(resolve(_config(tmp_path, ck, steps=2)))
    assert main(_train_cli(tmp_path, "--checkpoint-dir", str(ck), "--steps", "2")) == 2
    assert "already holds checkpoints" in _one_line(capsys)
    # --overwrite: nothing is deleted before this run's first checkpoint is complete ...
    Trainer(resolve(_config(tmp_path, ck, steps=2, overwrite=True, model=dict(TINY, hidden=64)))).close()
    assert _names(ck) == ["step-00000002", "step-00000004"]
    # ... then every earlier checkpoint goes, and --resume continues the new run
    run_training(_config(tmp_path, ck, steps=3, every=1, overwrite=True, model=dict(TINY, hidden=64)))
    assert _names(ck) == ["step-00000002", "step-00000003"]
    assert all(read_manifest(ck / n)["model"]["hidden"] == 64 for n in _names(ck))
    resumed = run_training(_config(tmp_path, ck, steps=4, resume=True, model=dict(TINY, hidden=64)))
    assert resumed.start_step == 3


def test_pruning_deletes_only_this_runs_checkpoints(tmp_path):
    """A longer earlier run's step-35 and step-40 beside this run's: --keep 1 keeps this run's
    newest (and theirs), where keeping the highest steps deleted each of this run's on writing it."""
    other = tmp_path / "other"
    run_training(_config(tmp_path, other, steps=2))
    ck = tmp_path / "ck"
    trainer = Trainer(resolve(_config(tmp_path, ck, steps=3, every=1, keep=1)))
    try:
        for step in (35, 40):  # put there behind the lock's back (or by an older pystronghold)
            shutil.copytree(other / "step-00000002", ck / f"step-000000{step}")
        trainer.train()
    finally:
        trainer.close()
    assert _names(ck) == ["step-00000003", "step-00000035", "step-00000040"]
    assert _writer(ck / "step-00000003") != _writer(ck / "step-00000040")


def test_resume_moves_a_corrupt_newest_aside_and_keeps_the_valid_one(tmp_path, caplog):
    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=4, every=2))
    block = ck / "step-00000004" / "blocks" / "block-00001.safetensors"
    block.write_bytes(block.read_bytes()[:-1] + b"?")
    with caplog.at_level(logging.WARNING):
        resumed = run_training(_config(tmp_path, ck, steps=3, every=1, keep=1, resume=True))
    assert resumed.start_step == 2
    assert "moved it aside as step-00000004.corrupt" in caplog.text
    # --keep 1: the checkpoint just written stays, the corrupt one is out of the way (kept)
    assert _names(ck) == ["step-00000003", "step-00000004.corrupt"]
    assert run_training(_config(tmp_path, ck, steps=4, resume=True)).start_step == 3
    # the resumed runs continue one lineage: the first run's id, then each resume's
    assert len(read_manifest(ck / "step-00000004")["lineage"]) == 3


def test_a_second_run_on_the_directory_is_refused_naming_the_holder(tmp_path, capsys):
    ck = tmp_path / "ck"
    first = Trainer(resolve(_config(tmp_path, ck, steps=2)))
    try:
        holder = f"PID {os.getpid()} on host {socket.gethostname()}"
        with pytest.raises(CheckpointError, match=f"in use by another run \\({holder}\\)"):
            Trainer(resolve(_config(tmp_path, ck, steps=2)))
        assert main(_train_cli(tmp_path, "--checkpoint-dir", str(ck), "--steps", "2")) == 2
        assert holder in _one_line(capsys)
    finally:
        first.close()
    run_training(_config(tmp_path, ck, steps=1))  # released by close (and by the kernel on kill -9:
    # test_train_checkpoint.py's random kills resume each killed run)


@pytest.mark.parametrize("damage", ["no file list", "no state.pt entry", "deleted"])
def test_manifest_damage_falls_back_like_file_damage(tmp_path, capsys, caplog, damage):
    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=4, every=2))
    manifest_file = ck / "step-00000004" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    if damage == "deleted":
        manifest_file.unlink()
    else:
        if damage == "no file list":
            del manifest["files"]
        else:
            del manifest["files"]["state.pt"]
        manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="step-00000004: .*manifest"):
        read_manifest(ck / "step-00000004")
    # export falls back (and says why), leaving the directory as it is
    with caplog.at_level(logging.WARNING):
        assert main(["export", str(ck), str(tmp_path / "w.safetensors")]) == 0
    assert f"weights of {ck / 'step-00000002'}" in capsys.readouterr().out
    assert "step-00000004: " in caplog.text and "manifest" in caplog.text
    assert latest_checkpoint(ck).name == "step-00000004"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(resolve(_config(tmp_path, ck, steps=4, resume=True)))
    trainer.close()
    assert trainer.step == 2 and "moved it aside as step-00000004.corrupt" in caplog.text


def test_a_full_disk_names_the_step_and_file_and_removes_the_partial_save(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    fsync = os.fsync

    def full_while_saving_step_4(fd):
        if ".tmp-step-00000004" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", full_while_saving_step_4)
    code = main(_train_cli(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--steps", "4",
                           "--log-every", "2"))
    err = _one_line(capsys)
    assert code == 1
    assert "error: checkpoint of step 4 not written: No space left on device (" in err
    assert f"{ck}/.tmp-step-00000004-{os.getpid()}/blocks/block-00000.safetensors)" in err
    assert "partial save was removed" in err and "at step" not in err
    assert _names(ck) == ["step-00000002"]  # no .tmp left on the full disk
    assert newest_valid_checkpoint(ck) == ck / "step-00000002"


def test_resuming_another_models_checkpoint_says_what_differs_in_one_line(tmp_path, capsys):
    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=2))
    with pytest.raises(CheckpointError) as info:
        Trainer(resolve(_config(tmp_path, ck, steps=3, resume=True, model=dict(TINY, hidden=64, heads=4, layers=3))))
    assert str(info.value) == (f"checkpoint {ck / 'step-00000002'} was made for another model: layers 4 (this "
                               "run 3), hidden 32 (this run 64), heads 2 (this run 4)")
    run_training(_config(tmp_path, ck, steps=3, resume=True))  # the failed run let the directory go


class _Killed(Exception):
    """Stands for a kill at a chosen point of a run (raised by a test hook)."""


def test_an_overwrite_run_killed_before_it_deleted_the_old_checkpoints_is_resumed_not_the_old_run(
        tmp_path, monkeypatch, caplog):
    """The kill lands after the --overwrite run's first checkpoint is complete, before the old run's
    (at higher steps) are deleted: --resume continues the new run, names the old ones as another
    run's, and its first checkpoint deletes them (the --overwrite's permission)."""
    import pystronghold.train.loop as loop

    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=4, every=2))
    prune = loop.prune_checkpoints

    def killed(*args, **kwargs):
        raise _Killed

    monkeypatch.setattr(loop, "prune_checkpoints", killed)
    with pytest.raises(_Killed):
        run_training(_config(tmp_path, ck, steps=3, every=1, overwrite=True))
    monkeypatch.setattr(loop, "prune_checkpoints", prune)
    assert _names(ck) == ["step-00000001", "step-00000002", "step-00000004"]
    new_run = _writer(ck / "step-00000001")
    with caplog.at_level(logging.WARNING):
        resumed = run_training(_config(tmp_path, ck, steps=3, resume=True))
    assert resumed.start_step == 1
    assert f"checkpoint {ck / 'step-00000004'} is another run's than the directory's" in caplog.text
    assert _names(ck) == ["step-00000001", "step-00000003"]
    assert read_manifest(ck / "step-00000003")["lineage"][0] == new_run


def test_the_checkpoints_listed_at_the_end_are_those_keep_left(tmp_path, caplog):
    ck = tmp_path / "ck"
    result = run_training(_config(tmp_path, ck, steps=4, every=1, keep=2))
    assert result.checkpoints == [str(ck / "step-00000003"), str(ck / "step-00000004")]
    with caplog.at_level(logging.INFO):
        assert main(_train_cli(tmp_path, "--checkpoint-dir", str(tmp_path / "ck2"), "--steps", "3",
                               "--checkpoint-every", "1", "--keep", "1")) == 0
    wrote = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote ")]
    assert wrote == [f"wrote {tmp_path / 'ck2' / 'step-00000003'}"]


def _interrupt_save_of_step(monkeypatch, step: int, after_files: int) -> None:
    """A KeyboardInterrupt (a second Ctrl-C) inside the save of ``step``, after its first files."""
    import pystronghold.train.checkpoint as checkpoint

    save = checkpoint.save_checkpoint

    def interrupted(state, root, record, **kw):
        written = []

        def after_file(name):
            written.append(name)
            if record.step == step and len(written) == after_files:
                raise KeyboardInterrupt
        return save(state, root, record, _after_file=after_file)

    monkeypatch.setattr(checkpoint, "save_checkpoint", interrupted)  # the loop looks it up at each save


def test_a_second_ctrl_c_inside_a_save_removes_it_and_names_its_step(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    _interrupt_save_of_step(monkeypatch, 4, after_files=2)
    code = main(_train_cli(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--steps", "6"))
    assert code == 1
    assert _one_line(capsys) == ("pystronghold train: error: interrupted again while writing the checkpoint of "
                                 "step 4: not written, its partial save was removed")
    assert _names(ck) == ["step-00000002"]


def test_a_partial_save_that_cannot_be_removed_is_named_not_said_removed(tmp_path, capsys, monkeypatch):
    """A read-only file system: the write fails, and so does the removal of what was written."""
    import pystronghold.train.checkpoint_save as checkpoint_save

    ck = tmp_path / "ck"
    fsync, rmtree = os.fsync, shutil.rmtree

    def read_only_while_saving_step_4(fd):
        if ".tmp-step-00000004" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        fsync(fd)

    def keeps_partial_saves(path, *args, **kwargs):
        if ".tmp-step-" not in str(path):
            rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", read_only_while_saving_step_4)
    monkeypatch.setattr(checkpoint_save.shutil, "rmtree", keeps_partial_saves)
    code = main(_train_cli(tmp_path, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--steps", "4"))
    err = _one_line(capsys)
    assert code == 1 and "removed" not in err
    assert err.endswith(f"its partial save {ck}/.tmp-step-00000004-{os.getpid()} is left (remove it by hand)"), err


def test_an_overwrite_run_killed_between_marking_the_directory_and_its_first_checkpoint_resumes_nothing(
        tmp_path, monkeypatch):
    """The directory is the new run's as soon as it is marked: its first checkpoint not yet renamed
    into place, --resume finds nothing of it and refuses, rather than continuing the old run."""
    import pystronghold.train.checkpoint_save as checkpoint_save

    ck = tmp_path / "ck"
    run_training(_config(tmp_path, ck, steps=4, every=2))
    mark = checkpoint_save.mark_run

    def marked_then_killed(*args, **kwargs):
        mark(*args, **kwargs)
        raise _Killed

    monkeypatch.setattr(checkpoint_save, "mark_run", marked_then_killed)
    with pytest.raises(_Killed):
        run_training(_config(tmp_path, ck, steps=3, every=1, overwrite=True))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"--resume: no valid checkpoint in .*step-00000004 is another run's "
                                              r"than the directory's .*\(and 1 older"):
        Trainer(resolve(_config(tmp_path, ck, steps=3, resume=True)))
