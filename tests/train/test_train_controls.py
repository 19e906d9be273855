"""`pystronghold train` controls: --version, Ctrl-C / SIGTERM, --metrics-file, --tensorboard, plain
progress lines when stderr is not a terminal, falling back from a corrupt checkpoint on --resume."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from pystronghold import __version__
from pystronghold.cli import main
from pystronghold.train import Trainer, resolve
from pystronghold.train.command import StopOnSignal
from pystronghold.train.metrics import IntervalMetrics
from train_helpers import TINY, kill_when_marked, run_training, text_dir, tiny_config

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _cli(tmp_path, *extra: str) -> list[str]:
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    return [sys.executable, "-m", "pystronghold", "train", "--model", str(model), "--data",
            str(text_dir(tmp_path)), "--max-bytes", "65536", "--batch", "4", "--seq", "32",
            "--eval-batches", "1", "--eval-every", "0", *extra]


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pystronghold {__version__}"


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_the_step_writes_a_checkpoint_and_exits(tmp_path, sig, status):
    ck = tmp_path / "ck"
    child = subprocess.Popen(_cli(tmp_path, "--steps", "100000", "--log-every", "1", "--checkpoint-dir",
                                  str(ck), "--quiet"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in child.stdout:  # the first metrics line: training is under way
            if line.startswith("step 1 |"):
                break
        else:
            pytest.fail(f"the run ended before its first step: {child.stderr.read()[-2000:]}")
        child.send_signal(sig)
        out, err = child.communicate(timeout=180)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == status, err[-2000:]
    assert "Traceback" not in err
    final = err.strip().splitlines()[-1]
    name = signal.Signals(sig).name
    assert final.startswith(f"pystronghold train: stopped by {name} after step "), err
    step = int(final.split("after step ")[1].split(";")[0])
    assert step >= 1 and f"checkpoint {ck / f'step-{step:08d}'}" in final
    assert (ck / f"step-{step:08d}" / "manifest.json").is_file()


# NOTE: the child restores Python's own SIGINT handler: a shell starts background jobs with SIGINT
# ignored, and a child inherits that. Start-up is held at a hook (first the data, then the LR
# schedule, made once the engine and its threads exist) until the signal interrupts it.
START_UP_SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import pystronghold.train.loop as loop

def held(*args, **kwargs):
    open({marker!r}, "w").close()
    time.sleep(600)

assert hasattr(loop, {hook!r})  # the hook is what the loop calls
setattr(loop, {hook!r}, held)
from pystronghold.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("hook", ["training_corpus", "warmup_cosine"])
def test_ctrl_c_during_start_up_is_one_line_and_status_130(tmp_path, hook):
    marker, err = tmp_path / "started", tmp_path / "stderr.txt"
    script = START_UP_SCRIPT.format(marker=str(marker), hook=hook, argv=_cli(tmp_path, "--steps", "2")[3:])
    status = kill_when_marked(script, marker, f"start-up ({hook})", sig=signal.SIGINT, stderr=err)
    text = err.read_text()
    assert status == 130 and "Traceback" not in text, text[-2000:]
    assert text.strip().splitlines() == ["pystronghold train: interrupted during start-up"], text


# NOTE: the signal is sent by the child itself at a chosen point of start-up (a finder that sees the
# import of a module, or the --nvme probe file's creation): deterministic, no waiting.
SELF_SIGNAL_SCRIPT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # see START_UP_SCRIPT
at, sig = sys.argv[1], getattr(signal, sys.argv[2])


def kick():
    os.kill(os.getpid(), sig)


class Kick:
    def find_spec(self, name, path=None, target=None):
        if name == at:
            sys.meta_path.remove(self)
            kick()


if at == "probe":
    import pystronghold.io.scratch as scratch
    original = scratch.os.open

    def open_then_signal(path, *args, **kwargs):
        fd = original(path, *args, **kwargs)
        if ".pystronghold-probe-" in str(path):
            kick()
        return fd

    scratch.os.open = open_then_signal
else:
    sys.meta_path.insert(0, Kick())
sys.argv = ["pystronghold", *sys.argv[3:]]
from pystronghold.cli import run
run()
"""


@pytest.mark.parametrize("at", ["numpy", "pystronghold.train.loop", "probe"])
@pytest.mark.parametrize("sig,status,line", [
    (signal.SIGINT, 130, "pystronghold train: interrupted during start-up"),
    (signal.SIGTERM, 143, "pystronghold train: terminated during start-up (SIGTERM)")], ids=["SIGINT", "SIGTERM"])
def test_a_signal_anywhere_in_start_up_is_one_line_and_leaves_nothing(tmp_path, at, sig, status, line):
    """While torch loads numpy (a Ctrl-C there was lost: the run went on), while the loop's module
    is imported, and in the --nvme probe (its file was left behind): one line, 128 + the signal,
    no probe file."""
    nvme = tmp_path / "nvme"
    argv = _cli(tmp_path, "--steps", "2", "--nvme", str(nvme), "--quiet")[3:]
    p = subprocess.run([sys.executable, "-c", SELF_SIGNAL_SCRIPT, at, signal.Signals(sig).name, *argv],
                       capture_output=True, text=True, timeout=180, env=ENV)
    assert p.returncode == status, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [line], p.stderr[-2000:]
    assert "| loss" not in p.stdout  # no step ran
    assert not nvme.exists() or list(nvme.iterdir()) == []


def test_a_second_signal_stops_at_once():
    class Run:
        step, stop_requested = 3, None

    run = Run()
    stopper = StopOnSignal(run)
    stopper.handle(signal.SIGINT)
    assert run.stop_requested == "SIGINT" and stopper.exit_status == 130
    with pytest.raises(KeyboardInterrupt):
        stopper.handle(signal.SIGINT)


def test_metrics_file_has_one_json_object_per_metrics_line(tmp_path):
    config = tiny_config(tmp_path, steps=6)
    config.run = dataclasses.replace(config.run, metrics_file=str(tmp_path / "run.jsonl"), eval_every=3)
    res = run_training(config)
    rows = [json.loads(s) for s in (tmp_path / "run.jsonl").read_text().splitlines()]
    metrics = [r for r in rows if "loss" in r]
    assert [r["step"] for r in metrics] == [m.step for m in res.intervals] == [2, 4, 6]
    assert all(set(r) == set(IntervalMetrics.__dataclass_fields__) for r in metrics)
    assert [r["loss"] for r in metrics] == [m.loss for m in res.intervals]
    assert [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r] == res.val_losses


def _killed_in_step_4_and_resumed(tmp_path, between=lambda: None, **outputs) -> list:
    """Train 4 steps (checkpoint every 2, a metrics line every step) with RunOptions ``outputs``,
    failing in step 4 (as if killed), call ``between()``, then resume from step 2 to the end.
    Returns the resumed run's metrics lines."""
    def config(resume: bool):
        c = tiny_config(tmp_path, steps=4, ckpt=str(tmp_path / "ck"), every=2, resume=resume)
        c.run = dataclasses.replace(c.run, log_every=1, **outputs)
        return c

    def killed_in_step_4(step: int, loss: float) -> None:
        if step == 4:  # before its metrics line
            raise RuntimeError("killed")

    trainer = Trainer(resolve(config(resume=False)))
    try:
        with pytest.raises(RuntimeError, match="killed"):
            trainer.train(killed_in_step_4)
    finally:
        trainer.close()
    between()
    result = run_training(config(resume=True))
    assert result.start_step == 2
    return result.intervals


def test_a_resumed_run_writes_each_step_once_in_the_metrics_file(tmp_path):
    jsonl = tmp_path / "run.jsonl"
    first: list[dict] = []

    def read_and_tear() -> None:  # the killed run's records, then a line torn by the kill
        first.extend(json.loads(s) for s in jsonl.read_text().splitlines())
        with open(jsonl, "a") as f:
            f.write('{"step": 4, "lo')

    resumed = _killed_in_step_4_and_resumed(tmp_path, read_and_tear, metrics_file=str(jsonl))
    assert [r["step"] for r in first] == [1, 2, 3]
    rows = [json.loads(s) for s in jsonl.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert rows[:2] == first[:2]  # kept as they were
    assert [r["loss"] for r in rows[2:] if "loss" in r] == [m.loss for m in resumed]
    assert [r["step"] for r in rows if "val_loss" in r] == [4]


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    resumed = _killed_in_step_4_and_resumed(tmp_path, tensorboard=str(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4]
    assert [e.value for e in losses[2:]] == pytest.approx([m.loss for m in resumed], rel=1e-6)  # stored as fp32


def test_metrics_file_in_a_missing_directory_is_one_line(capsys, tmp_path):
    assert main(["train", "--metrics-file", str(tmp_path / "nosuch" / "run.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--metrics-file" in err


def test_tensorboard_without_the_package_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if tensorboard were not installed
                        lambda name, *a, **k: None if name == "tensorboard" else find_spec(name, *a, **k))
    assert main(["train", "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tensorboard needs the 'tensorboard' package" in err


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writes_event_files(tmp_path):
    config = tiny_config(tmp_path, steps=2)
    config.run = dataclasses.replace(config.run, tensorboard=str(tmp_path / "tb"))
    run_training(config)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(tmp_path):
    proc = subprocess.run(_cli(tmp_path, "--steps", "4", "--log-every", "2"), capture_output=True,
                          text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr
    lines = [s for s in proc.stderr.splitlines() if s.startswith("train: step ")]
    assert [s.split(" (")[0] for s in lines] == [f"train: step {k}/4" for k in (1, 2, 3, 4)]


def test_resume_falls_back_from_a_corrupt_latest_checkpoint(tmp_path, caplog):
    ck = tmp_path / "ck"
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=4, ckpt=str(ck), every=2)))
    try:
        trainer.train()
    finally:
        trainer.close()
    bad = ck / "step-00000004" / "blocks" / "block-00001.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="pystronghold.train.checkpoint"):
        trainer = Trainer(resolve(tiny_config(tmp_path, steps=6, ckpt=str(ck), every=2, resume=True)))
    try:
        assert trainer.step == 2
    finally:
        trainer.close()
    text = caplog.text
    assert "step-00000004: blocks/block-00001.safetensors is corrupt" in text
    assert f"falling back to {ck / 'step-00000002'}" in text


def test_validation_runs_in_eval_mode_and_training_resumes_in_train_mode(tmp_path):
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=2, model=dict(TINY, dropout=0.5))))
    try:
        first, second = trainer.evaluate(), trainer.evaluate()
        assert first == second  # no dropout in validation
        assert trainer.engine.training and all(m.training for m in trainer.model.modules())
    finally:
        trainer.close()
