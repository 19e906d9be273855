"""--resume with options given again: changed optimizer and schedule settings applied from the
resumed step (one line each), a changed --seed refused, a checkpoint of another model or with
inf/NaN states fallen back from, a checkpoint past --steps said in one line."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pystronghold.cli import main
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint import CheckpointError
from pystronghold.train.config import OptimOptions
from train_helpers import TINY, run_training, tiny_config


def _with_lr(config, lr: float, given=None):
    return dataclasses.replace(config, optim=OptimOptions(lr=lr, warmup=2), given=given)


def _checkpointed(tmp_path, steps: int = 6, every: int = 3):
    """A run's checkpoint directory, every one kept but the last (deleted, as if the run had been
    killed before it)."""
    ck = tmp_path / "ck"
    config = tiny_config(tmp_path, steps=steps, ckpt=str(ck), every=every)
    run_training(dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, keep=steps)))
    shutil.rmtree(ck / f"step-{steps:08d}")
    return ck


def _resume_lines(caplog, prefix: str = "resume: ") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def _changes(caplog) -> list[str]:
    """The lines that say which option a resume applied."""
    return _resume_lines(caplog, "resume: --")


def test_resume_with_a_changed_lr_gives_the_losses_of_a_run_that_changed_it_at_that_step(tmp_path, caplog):
    """The reference changes the peak learning rate of an uninterrupted run after step 3 through the
    Python API (the scheduler's base rates and the groups' current rates); the resumed run with the
    other --lr gives its losses bit for bit (fp32), and one line says so."""
    a, b = 3e-3, 1e-3
    reference = Trainer(resolve(_with_lr(tiny_config(tmp_path, steps=6), a)))
    try:
        for _ in range(3):
            reference.train_step()
        sched = reference.scheduler
        sched.base_lrs = [b] * len(sched.base_lrs)
        for g in reference.engine.optimizer.param_groups:
            g["initial_lr"], g["lr"] = b, b * sched.lr_lambdas[0](sched.last_epoch)
        want = [(reference.step + 1, reference.train_step()) for _ in range(3)]
    finally:
        reference.close()
    ck = _checkpointed(tmp_path)
    with caplog.at_level(logging.INFO):
        resumed = run_training(_with_lr(tiny_config(tmp_path, steps=6, ckpt=str(ck), resume=True), b,
                                        given=frozenset({"optim.lr"})))
    assert resumed.start_step == 3
    assert resumed.losses == want
    assert _changes(caplog) == ["resume: --lr 0.003 -> 0.001 (applied from step 4)"]


def test_resume_with_nothing_changed_is_bit_for_bit_and_silent(tmp_path, caplog):
    straight = run_training(tiny_config(tmp_path, steps=6))
    ck = _checkpointed(tmp_path)
    with caplog.at_level(logging.INFO):
        resumed = run_training(tiny_config(tmp_path, steps=6, ckpt=str(ck), resume=True))  # every field given
    assert resumed.losses == straight.losses[3:]
    assert _changes(caplog) == []


def _cli(tmp_path, ck, *extra: str) -> list[str]:
    tiny_config(tmp_path)  # writes model.json and the text
    return ["train", "--model", str(tmp_path / "model.json"), "--data", str(tmp_path / "text"), "--max-bytes",
            "65536", "--batch", "4", "--seq", "32", "--window", "2", "--eval-every", "0", "--quiet",
            "--checkpoint-dir", str(ck), *extra]


def _saved_settings(path) -> tuple[list[dict], object, list[float]]:
    state = torch.load(path / "state.pt", weights_only=False)
    schedule = state["scheduler"]["lr_lambdas"][0]
    return state["hyper"], schedule, state["scheduler"]["base_lrs"]


def test_only_options_given_on_the_command_line_change_a_resumed_run(tmp_path, caplog):
    """The first run sets --lr 1e-3; a resume without --lr keeps it (the model's default, 2e-3, is no
    change), and one giving the optimizer's and the schedule's options applies each, one line each."""
    ck = tmp_path / "ck"
    assert main(_cli(tmp_path, ck, "--steps", "2", "--lr", "1e-3", "--warmup", "2")) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(_cli(tmp_path, ck, "--steps", "3", "--resume")) == 0
    assert _changes(caplog) == []
    hyper, schedule, peaks = _saved_settings(ck / "step-00000003")
    assert peaks == [1e-3, 1e-3] and schedule["warmup_steps"] == 2
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(_cli(tmp_path, ck, "--steps", "4", "--resume", "--beta2", "0.95", "--weight-decay", "0.1",
                         "--warmup", "1", "--min-lr-ratio", "0.5")) == 0
    assert _changes(caplog) == [f"resume: {change} (applied from step 4)" for change in
                                     ("--beta2 0.99 -> 0.95", "--weight-decay 0.01 -> 0.1", "--warmup 2 -> 1",
                                      "--min-lr-ratio 0.1 -> 0.5")]
    hyper, schedule, peaks = _saved_settings(ck / "step-00000004")
    assert [h["betas"] for h in hyper] == [(0.9, 0.95)] * 2
    assert [h["weight_decay"] for h in hyper] == [0.1, 0.0]  # --decay matrices: biases and gains never decay
    assert schedule["warmup_steps"] == 1 and schedule["min_ratio"] == 0.5 and peaks == [1e-3, 1e-3]


@pytest.mark.parametrize("option, words", [("--seed", "--seed 1 differs from checkpoint"),
                                           ("--batch", "made with other data settings: --batch 4 (this run 1); a resumed run keeps")])
def test_a_changed_seed_or_batch_on_resume_is_refused_in_one_line_naming_it(tmp_path, capsys, option, words):
    ck = tmp_path / "ck"
    assert main(_cli(tmp_path, ck, "--steps", "2")) == 0
    capsys.readouterr()
    assert main(_cli(tmp_path, ck, "--steps", "3", "--resume", option, "1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    same = {"--seed": "0", "--batch": "4"}[option]
    assert main(_cli(tmp_path, ck, "--steps", "3", "--resume", option, same)) == 0  # given, the same: fine


def test_resuming_past_steps_says_there_is_nothing_to_train(tmp_path, caplog):
    ck = tmp_path / "ck"
    assert main(_cli(tmp_path, ck, "--steps", "4")) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(_cli(tmp_path, ck, "--steps", "3", "--resume")) == 0
    assert "resume: checkpoint step-00000004 is at step 4, --steps 3: nothing to train (give a larger --steps " \
           "to go on)" in _resume_lines(caplog)


# ---- a newest checkpoint this run cannot continue: fall back

def _rewrite(path, rel: str, change) -> None:
    """Apply ``change`` to the tensors of file ``rel`` of checkpoint ``path`` and record its new
    checksum in the manifest: whole, as if it had been written so."""
    tensors = load_file(str(path / rel))
    change(tensors)
    save_file(tensors, str(path / rel))
    data = (path / rel).read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(path, **changes) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    for key, value in changes.items():
        manifest[key] = value(manifest[key])
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, why", [
    ("model", "was made for another model: hidden 64 (this run 32)"),
    ("blocks", "holds 3 blocks, this run's model 4"),
    ("nan moment", "blocks/block-00001.safetensors: blocks.1.attn.qkv.weight.exp_avg holds NaN values"),
    ("inf master", "head_tail.safetensors: head.tok.weight holds inf values"),
])
def test_a_newest_checkpoint_this_run_cannot_continue_is_skipped_for_the_older_one(tmp_path, caplog, damage, why):
    """Its checksums match: it is not moved aside, the resume takes the older one (every state of
    which replaces what the skipped one had loaded) and gives the uninterrupted losses."""
    straight = run_training(tiny_config(tmp_path, steps=6))
    ck = _checkpointed(tmp_path, steps=6, every=2)
    newest = ck / "step-00000004"
    if damage == "model":
        _edit_manifest(newest, model=lambda m: dict(m, hidden=64))
    elif damage == "blocks":
        _edit_manifest(newest, blocks=lambda n: n - 1)
    elif damage == "nan moment":
        _rewrite(newest, "blocks/block-00001.safetensors",
                 lambda t: t["blocks.1.attn.qkv.weight.exp_avg"].view(-1).__setitem__(5, float("nan")))
    else:
        _rewrite(newest, "head_tail.safetensors", lambda t: t["head.tok.weight"].view(-1).__setitem__(0, float("inf")))
    with caplog.at_level(logging.INFO):
        resumed = run_training(tiny_config(tmp_path, steps=6, ckpt=str(ck), resume=True))
    assert resumed.start_step == 2 and resumed.losses == straight.losses[2:]
    skipped = [line for line in _resume_lines(caplog) if line.startswith("resume: skipped")]
    assert len(skipped) == 1 and skipped[0].startswith(f"resume: skipped step-00000004: checkpoint {newest}")
    assert why in skipped[0], skipped[0]
    assert newest.is_dir()  # kept where it was: whole, only not this run's to continue


def test_resume_refuses_when_no_checkpoint_fits(tmp_path):
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, steps=4, ckpt=str(ck), every=2))
    with pytest.raises(CheckpointError) as info:
        Trainer(resolve(tiny_config(tmp_path, steps=6, ckpt=str(ck), resume=True, model=dict(TINY, hidden=64))))
    assert str(info.value) == (f"checkpoint {ck / 'step-00000004'} was made for another model: hidden 32 (this run "
                               "64) (and the 1 older valid one(s) do not fit either)")


def test_the_readmes_code_loads_a_cli_checkpoint_into_an_engine(tmp_path, monkeypatch):
    """README's snippet, run as written in a directory holding the CLI's ``ck``: the engine's values
    are the checkpoint's (two steps away from the initial ones the snippet's model starts with)."""
    import re
    from pathlib import Path

    from pystronghold.train.checkpoint import checkpoint_weights, read_manifest

    ck = tmp_path / "ck"
    assert main(_cli(tmp_path, ck, "--steps", "2")) == 0
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    snippet = next(code for code in re.findall(r"```python\n(.*?)```", readme, re.S)
                   if 'newest_valid_checkpoint("ck")' in code)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    engine = scope["engine"]
    try:
        path = ck / "step-00000002"
        saved = {k: v for part in checkpoint_weights(path, read_manifest(path)) for k, v in part.items()}
        masters = engine.master_parameters()
        assert saved.keys() <= masters.keys() and len(saved) > 10
        for name, value in saved.items():
            assert torch.equal(masters[name], value), name
    finally:
        engine.close()
