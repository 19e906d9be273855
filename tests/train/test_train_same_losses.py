"""The same ``pystronghold train`` command lines give the same losses as before the settings were
resolved once (``train.run.resolve``): our GPT, a Hugging Face Llama (hf:DIR, a tiny random config)
and a --resume, each a few steps through the CLI, every training and validation loss compared
exactly with the floats main's code (commit b0a7672) wrote for the same commands on the CPU backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from train_helpers import TINY, text_dir

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--steps", "4", "--log-every", "1", "--eval-every", "2", "--eval-batches", "1", "--batch", "2",
          "--seq", "16", "--max-bytes", "16384", "--window", "2", "--quiet"]

RECORDED = {
    "gpt": [[1, 5.508331298828125], [2, 5.488445281982422], [3, 5.260642051696777], [4, 5.372834205627441],
            [2, 5.255619525909424], [4, 5.087764739990234]],
    "hf": [[1, 5.703774452209473], [2, 5.71159029006958], [3, 5.637560844421387], [4, 5.608644962310791],
           [2, 5.689636707305908], [4, 5.600917339324951]],
    "resume": [[1, 5.508331298828125], [2, 5.438324928283691], [3, 5.194326877593994], [4, 5.364579677581787],
               [2, 5.174506187438965], [4, 5.151422023773193]],
}
"""The losses (``(step, training loss)`` of each metrics line, then ``(step, validation loss)``)
main's code wrote for each command below."""


def train(tmp_path: Path, *argv: str, pythonpath: str = str(ROOT)) -> tuple[list, list]:
    """The metrics file's (step, loss) and (step, validation loss) of ``pystronghold train argv``."""
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "pystronghold", "train", *COMMON, *argv, "--metrics-file", str(metrics)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val_losses = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return train_losses, val_losses


def commands(tmp_path: Path, name: str) -> list[list[str]]:
    """The argument lists of command ``name``, run one after the other in ``tmp_path`` (the metrics
    file, appended to on --resume, holds every step's loss)."""
    if name == "hf":
        from hf_models import TEXT, save_tiny

        directory = save_tiny(tmp_path, "llama")
        data = tmp_path / "hf.txt"
        data.write_text("".join(TEXT) * 8)
        return [["--model", f"hf:{directory}", "--data", str(data), "--lr", "1e-3"]]
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    gpt = ["--model", str(model), "--data", str(text_dir(tmp_path))]
    if name == "gpt":
        return [gpt]
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    return [gpt + ck + ["--checkpoint-every", "2", "--steps", "2"], gpt + ck + ["--resume"]]


def losses_of(tmp_path: Path, name: str, pythonpath: str = str(ROOT)) -> tuple[list, list]:
    """The losses of command ``name`` (``commands``) run with the package found on ``pythonpath``."""
    for argv in commands(tmp_path, name):
        got = train(tmp_path, *argv, pythonpath=pythonpath)
    return got


@pytest.mark.parametrize("name", ["gpt", "hf", "resume"])
def test_the_cli_gives_the_losses_it_gave_before(tmp_path, name):
    if name == "hf":
        pytest.importorskip("transformers")
    train_losses, val_losses = losses_of(tmp_path, name)
    assert [list(x) for x in train_losses] + [list(x) for x in val_losses] == RECORDED[name]
