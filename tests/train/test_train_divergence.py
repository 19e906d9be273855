"""`pystronghold train` stops a diverged run: one line naming the step, exit status 1 (fp16 once its
skipped steps cannot recover, bf16/fp32 at the first inf/NaN gradient, clipped or not); it never
writes a checkpoint holding inf/NaN; and it counts fp16's skipped steps in the summary and metrics."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pystronghold.cli import main
from pystronghold.runtime.optimizer.divergence import DivergenceError
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint_dir import latest_checkpoint
from train_helpers import run_training, save_trainer, tiny_config

TRAIN = ["train", "--model", "tiny", "--steps", "40", "--batch", "2", "--seq", "16", "--eval-batches", "1",
         "--quiet", "--max-bytes", "16384", "--lr", "1e3"]


def _text(tmp_path) -> str:
    text = tmp_path / "t.txt"
    text.write_text("hello world, a few bytes of training text\n" * 400)
    return str(text)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pystronghold train: error: step "), err
    assert "lower the learning rate" in err and "Traceback" not in err
    return err


def test_fp16_at_a_huge_learning_rate_stops_with_one_line_and_writes_no_later_checkpoint(tmp_path, capsys):
    ck = tmp_path / "ck"
    argv = TRAIN + ["--data", _text(tmp_path), "--precision", "fp16", "--checkpoint-dir", str(ck)]
    assert main(argv) == 1
    err = _error_line(capsys)
    found = re.search(r"step (\d+): (\d+) steps in a row skipped for inf/NaN fp16 gradients \((\d+) skipped in "
                      r"all\) and the loss scale is at its floor, 1;", err)
    assert found, err
    step, in_a_row, skipped = map(int, found.groups())
    assert step < 40 and in_a_row == skipped >= 17  # 2**16 backs off to 1 in 16 skips
    assert latest_checkpoint(ck) is None  # the end-of-run checkpoint was never reached

    assert main(argv + ["--max-skipped-steps", "3"]) == 1
    err = _error_line(capsys)
    assert re.search(r"step \d+: 3 steps in a row skipped .* and that is max_skipped_steps "
                     r"\(--max-skipped-steps 3\);", err), err


@pytest.mark.parametrize("precision,clip,what", [
    ("bf16", "1.0", r"the gradient norm is (nan|inf): inf/NaN gradients in \d+ of \d+ parameters, the first \S+; "
                    r"nothing was updated;"),
    ("fp32", "1.0", r"the gradient norm is (nan|inf): inf/NaN gradients in \d+ of \d+ parameters"),
    ("bf16", "0", r"the gradient of block \d has inf/NaN values; its update was not applied;"),
    ("fp32", "0", r"the gradient of block \d has inf/NaN values"),
], ids=["bf16-clip", "fp32-clip", "bf16-noclip", "fp32-noclip"])
def test_bf16_and_fp32_stop_at_the_first_inf_or_nan_gradient_in_one_line(tmp_path, capsys, precision, clip, what):
    assert main(TRAIN + ["--data", _text(tmp_path), "--precision", precision, "--clip", clip]) == 1
    err = _error_line(capsys)
    assert re.search(r"error: step \d+: " + what, err), err
    assert "skip such steps" not in err


def test_a_checkpoint_with_inf_adam_moments_is_not_written(tmp_path):
    """Gradients of 1e23 are finite in fp32, their squares are not: exp_avg_sq turns inf (the
    parameters do not move: m / sqrt(inf) is 0). Saving refuses it, naming the tensor."""
    ck = tmp_path / "ck"
    trainer = Trainer(resolve(tiny_config(tmp_path, clip=None, ckpt=str(ck))))
    try:
        plain_loss = trainer.stepper.loss
        trainer.stepper.loss = lambda x, y: plain_loss(x, y) * 1e25
        trainer.train_step()
        with pytest.raises(DivergenceError, match=r"^step 1: not writing checkpoint step-00000001 \(blocks/block-00000"
                                                  r"\.safetensors\): \S+\.exp_avg_sq holds inf values;"):
            save_trainer(trainer, ck)
    finally:
        trainer.close()
    assert latest_checkpoint(ck) is None and not list(ck.glob("step-*"))


def test_skipped_fp16_steps_are_counted_in_the_summary_and_the_metrics(tmp_path):
    config = tiny_config(tmp_path, steps=12, precision="fp16")
    config.runtime = dataclasses.replace(config.runtime, initial_loss_scale=2.0**26)  # overflows at first
    config.run.metrics_file = str(tmp_path / "metrics.jsonl")
    trainer = run_training(config, keep=True)
    result, skipped = trainer.result, trainer.engine.skipped_steps
    assert 0 < skipped < 12 and result.skipped_steps == skipped
    assert sum(m.skipped_steps for m in result.intervals) == skipped
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(d["skipped_steps"] for d in lines if "skipped_steps" in d) == skipped
    assert f"; {skipped} skipped (fp16 inf/NaN gradients)" in result.summary_lines()[0]


def test_resume_continues_the_count_of_skipped_steps_in_a_row(tmp_path):
    """A run killed amid a run of skipped fp16 steps resumes with that count: the stop after
    --max-skipped-steps in a row cannot be dodged by restarting."""
    ck = str(tmp_path / "ck")
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=2, precision="fp16", ckpt=ck)))
    try:
        trainer.train()
        trainer.engine.scaler.overflows_in_a_row = 3  # as if the last three steps had been skipped
        save_trainer(trainer, ck)
    finally:
        trainer.close()
    resumed = Trainer(resolve(tiny_config(tmp_path, steps=3, precision="fp16", ckpt=ck, resume=True)))
    try:
        assert resumed.engine.scaler.overflows_in_a_row == 3
    finally:
        resumed.close()
