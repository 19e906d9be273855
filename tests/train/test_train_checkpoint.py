"""Checkpoints: exact resume (fp32), window independence, kills during steps and saves, corruption, export."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from pystronghold.models import GPT, GPTConfig
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint import CheckpointError, export_weights, load_checkpoint, read_manifest
from pystronghold.train.checkpoint_dir import latest_checkpoint, newest_valid_checkpoint
from train_helpers import TINY, kill_when_marked, listing, run_training, tiny_config


@pytest.mark.parametrize("clip, acc, window_after", [(1.0, 1, 2), (None, 1, 3), (1.0, 2, 1)])
def test_resume_reproduces_the_uninterrupted_losses(tmp_path, clip, acc, window_after):
    """Steps 4..6 after resuming from the step-3 checkpoint are bit-identical to a straight run;
    the resumed run may use another window (the format does not depend on W)."""
    straight = run_training(tiny_config(tmp_path, steps=6, clip=clip, accumulation=acc))
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, steps=6, clip=clip, accumulation=acc, ckpt=str(ck), every=3))
    assert listing(ck) == ["step-00000003", "step-00000006"]
    shutil.rmtree(ck / "step-00000006")  # as if the run had been killed after step 3
    resumed = run_training(tiny_config(tmp_path, steps=6, clip=clip, accumulation=acc, ckpt=str(ck), resume=True,
                               window=window_after))
    assert resumed.start_step == 3
    assert resumed.losses == straight.losses[3:]


def test_state_pt_holds_the_engines_state_dict_and_the_older_layout_still_resumes(tmp_path):
    """``state.pt`` keeps ``engine.state_dict()`` whole (step counts, fp16 loss scaler, layer drop);
    a checkpoint written before that, with the same values under keys of their own, resumes to the
    uninterrupted run's losses bit for bit (fp16: the loss scale comes back too)."""
    import hashlib

    from pystronghold.runtime.states.optimizer_state import ENGINE_STATE_KEYS

    straight = run_training(tiny_config(tmp_path, steps=4, precision="fp16"))
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, steps=4, precision="fp16", ckpt=str(ck), every=2))
    shutil.rmtree(ck / "step-00000004")
    path = ck / "step-00000002"
    state = torch.load(path / "state.pt", weights_only=False)
    engine = state.pop("engine")
    assert tuple(engine) == ENGINE_STATE_KEYS and engine["steps"] + engine["skipped_steps"] == 2
    assert engine["loss_scaler"] is not None
    state.update(engine_steps=engine["steps"], skipped_steps=engine["skipped_steps"],
                 block_steps=engine["block_steps"], layer_drop=engine["layer_drop"], scaler=engine["loss_scaler"])
    torch.save(state, path / "state.pt")
    data = (path / "state.pt").read_bytes()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    resumed = run_training(tiny_config(tmp_path, steps=4, precision="fp16", ckpt=str(ck), resume=True))
    assert resumed.start_step == 2
    assert resumed.losses == straight.losses[2:]


@pytest.mark.parametrize("precision, resident", [("fp32", 0), ("bf16", 1)])
def test_resume_with_frozen_parameters_reproduces_the_uninterrupted_losses(tmp_path, monkeypatch, precision,
                                                                           resident):
    """The resume above with frozen parameters (the first block wholly, every block's ln1, the
    position embedding): the checkpoint holds their values and no moments, the resumed steps are
    bit-identical, and the frozen values never change (rounded once to bf16 in a bf16 run). No
    CLI flag freezes parameters yet: the model the trainer builds is patched."""
    import pystronghold.train.build as build
    from safetensors.torch import load_file

    def is_frozen(name: str) -> bool:
        return name.startswith("blocks.0.") or ".ln1." in name or name == "head.pos.weight"

    def frozen_gpt(*args, **kwargs):
        model = GPT(*args, **kwargs)
        for name, p in model.named_parameters():
            p.requires_grad_(not is_frozen(name))
        return model

    monkeypatch.setattr(build, "GPT", frozen_gpt)
    options = dict(steps=6, precision=precision, resident=resident)
    straight = run_training(tiny_config(tmp_path, **options))
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, ckpt=str(ck), every=3, **options))
    shutil.rmtree(ck / "step-00000006")  # as if the run had been killed after step 3
    resumed = run_training(tiny_config(tmp_path, ckpt=str(ck), resume=True, **options), keep=True)
    assert resumed.result.start_step == 3
    assert resumed.result.losses == straight.losses[3:]
    saved = {}
    for f in sorted((ck / "step-00000003" / "blocks").iterdir()):
        saved.update(load_file(f))
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    initial = {n: p.detach().to(dtype).float() for n, p in GPT(GPTConfig(**TINY), seed=0).named_parameters()}
    final = resumed.engine.master_parameters()
    frozen_names = [n for n in initial if is_frozen(n)]
    for name in frozen_names:
        assert torch.equal(final[name], initial[name]), name
        if name in saved:  # a block parameter: its value, in the compute dtype, and no moments
            assert saved[name].dtype == dtype and torch.equal(saved[name].float(), initial[name]), name
            assert name + ".exp_avg" not in saved and name + ".exp_avg_sq" not in saved
    assert any(n + ".exp_avg" in saved for n in saved if not is_frozen(n))


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    marker = tmp_path / "saving"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parents[1])!r})
        from pathlib import Path
        from train_helpers import save_trainer, tiny_config
        from pystronghold.train import Trainer, resolve
        t = Trainer(resolve(tiny_config(Path({str(tmp_path)!r}), steps=10)))
        t.train_step(); t.train_step()
        save_trainer(t, {str(ck)!r})
        t.train_step()
        def slow(name):
            Path({str(marker)!r}).write_text(name)
            time.sleep(60)
        save_trainer(t, {str(ck)!r}, _after_file=slow)
    """)
    kill_when_marked(script, marker, "its second save")
    assert any(p.name.startswith(".tmp-step-00000003") for p in ck.iterdir())  # the half-written save
    latest = latest_checkpoint(ck)
    assert latest.name == "step-00000002"
    assert read_manifest(latest)["step"] == 2
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=3, ckpt=str(ck), resume=True)))
    try:
        assert trainer.step == 2
        trainer.train()
    finally:
        trainer.close()
    assert not any(p.name.startswith(".tmp") for p in ck.iterdir())  # cleaned up by the next save


def _loading(trainer, path):
    """``load_checkpoint``'s arguments to load checkpoint ``path`` into ``trainer``."""
    state, record = trainer.checkpoint_state()
    return state, path, record


def _saved(tmp_path):
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, steps=2, ckpt=str(ck)))
    return ck, latest_checkpoint(ck)


def test_corrupt_checkpoint_is_refused_before_anything_changes(tmp_path, capsys):
    ck, path = _saved(tmp_path)
    block = path / "blocks" / "block-00001.safetensors"
    data = bytearray(block.read_bytes())
    data[-3] ^= 0xFF
    block.write_bytes(bytes(data))
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=2)))
    try:
        before = {k: v.clone() for k, v in trainer.engine.master_parameters().items()}
        with pytest.raises(CheckpointError, match="block-00001.safetensors is corrupt"):
            load_checkpoint(*_loading(trainer, path))
        after = trainer.engine.master_parameters()
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        trainer.close()
    from pystronghold.cli import main

    code = main(["train", "--model", str(tmp_path / "model.json"), "--checkpoint-dir", str(ck), "--resume",
                 "--data", str(tmp_path / "text"), "--max-bytes", "65536", "--batch", "4", "--seq", "32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is corrupt" in err and len(err.splitlines()) == 1


def test_incompatible_or_incomplete_checkpoint_is_refused(tmp_path):
    ck, path = _saved(tmp_path)
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=2, model=dict(TINY, hidden=64))))
    try:
        with pytest.raises(CheckpointError, match="another model"):
            load_checkpoint(*_loading(trainer, path))
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps(dict(manifest, version=99)))
        with pytest.raises(CheckpointError, match="version 99"):
            load_checkpoint(*_loading(trainer, path))
        (path / "manifest.json").unlink()
        with pytest.raises(CheckpointError, match="no manifest"):
            load_checkpoint(*_loading(trainer, path))
    finally:
        trainer.close()


def test_export_loads_into_a_plain_gpt(tmp_path):
    ck = tmp_path / "ck"
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=3, ckpt=str(ck))))
    try:
        trainer.train()
        x, _ = trainer.val[0]
        with torch.no_grad():
            expected = trainer.engine(x)  # (B, T, V) logits through the window
    finally:
        trainer.close()
    out = export_weights(latest_checkpoint(ck), tmp_path / "model.safetensors")
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(out), "pt") as f:
        config = GPTConfig(**json.loads(f.metadata()["config"]))
    plain = GPT(config, seed=123)  # other initial weights: everything must come from the file
    plain.load_state_dict(load_file(str(out)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, rtol=0, atol=0)


_KILLABLE_RUN = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
import pystronghold.train.checkpoint as checkpoint
from pystronghold.train import Trainer, resolve
from train_helpers import tiny_config

kill_step, kill_file, marker = {step}, {file}, Path({marker!r})

def wait_for_the_kill():
    marker.write_text("here")
    time.sleep(120)

save = checkpoint.save_checkpoint

def save_or_die_inside(state, root, record, **options):  # the loop looks save_checkpoint up at each save
    written = []

    def after_file(name):
        if record.step == kill_step and len(written) == kill_file:
            wait_for_the_kill()
        written.append(name)
    return save(state, root, record, _after_file=after_file, **options)

checkpoint.save_checkpoint = save_or_die_inside

def on_step(step, loss):
    with open({losses!r}, "a") as f:
        f.write(f"{{step}} {{loss!r}}\\n")
    if step == kill_step and kill_file is None:
        wait_for_the_kill()  # after the step, before its checkpoint

trainer = Trainer(resolve(tiny_config(Path({tmp!r}), steps={steps}, ckpt={ck!r}, every=1, resume={resume})))
trainer.train(on_step)
"""


def test_random_kills_in_steps_and_saves_then_resume_gives_the_uninterrupted_losses(tmp_path):
    """SIGKILL at three seeded random points (after a step, or between two files of its save), each
    run resuming the one killed before it (which also proves the kernel released its lock): every
    loss any run logged, and the last run's, are the uninterrupted run's, bit for bit (fp32)."""
    import random

    steps = 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the children (kill_when_marked): the same sums in the same order
    try:
        _random_kills(tmp_path, steps, random.Random(49))  # kills in step 1's save, after step 4, in step 5's save
    finally:
        torch.set_num_threads(threads)


def _random_kills(tmp_path, steps, rng):
    straight = dict(run_training(tiny_config(tmp_path, steps=steps)).losses)
    ck, losses = tmp_path / "ck", tmp_path / "losses.txt"
    start = 0
    for kill in range(3):
        step = rng.randint(start + 1, steps)
        file = rng.choice([None, 0, 1, 2, 3, 4])  # None: before the save; k: after its k+1-th file
        marker = tmp_path / f"kill-{kill}"
        script = _KILLABLE_RUN.format(tests=str(Path(__file__).parents[1]), step=step, file=file,
                                      marker=str(marker), losses=str(losses), tmp=str(tmp_path), steps=steps,
                                      ck=str(ck), resume=start > 0)
        kill_when_marked(script, marker, f"kill point {kill} (step {step}, file {file})")
        newest = newest_valid_checkpoint(ck)
        assert newest is not None or step == 1, f"kill {kill}: no checkpoint of step {step - 1}"
        start = read_manifest(newest)["step"] if newest is not None else 0
        assert start == step - 1, f"kill {kill} at step {step}, file {file}: newest checkpoint at step {start}"
    logged = [line.split() for line in losses.read_text().splitlines()]
    assert logged and all(float(loss) == straight[int(s)] for s, loss in logged)
    last = run_training(tiny_config(tmp_path, steps=steps, ckpt=str(ck), resume=start > 0))
    assert last.losses == [(s, straight[s]) for s in range(start + 1, steps + 1)]
    # the checkpoint resumed and the last run's (at its end): --keep 2 of one lineage, no .tmp left
    assert listing(ck) == [f"step-{start:08d}", f"step-{steps:08d}"]
