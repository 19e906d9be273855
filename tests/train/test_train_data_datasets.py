"""A ``datasets`` save_to_disk directory as --data: the same corpus as the JSONL of its rows, its
"train" split of a DatasetDict, one-line errors, and exact resume."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pystronghold.runtime.config import RuntimeConfig
from pystronghold.tokenized import tokenized_corpus
from pystronghold.train.config import CheckpointOptions, DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import TEXT, VOCAB, save_tiny, set_chat_template
from train_helpers import cli_error, run_training

datasets = pytest.importorskip("datasets")

ROWS = [{"messages": [{"role": "user", "content": t[:12]}, {"role": "assistant", "content": t[12:]}]} for t in TEXT]


def _dataset(rows: list[dict]):
    # NOTE: an explicit fingerprint: Dataset.from_list hashes the table with dill, which fails in the
    # pinned environment (datasets 5.2.0, dill 0.4.1: "Can't pickle <class 'MonthDayNano'>");
    # reading a saved directory, what --data does, never hashes
    return datasets.Dataset(datasets.table.InMemoryTable.from_pylist(rows), fingerprint=f"rows{len(rows)}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = save_tiny(tmp_path_factory.mktemp("ds"), "llama")
    set_chat_template(directory)
    return directory


def _corpus(path, tokenizer):
    return tokenized_corpus([str(path)], tokenizer, max_bytes=1 << 20, val_fraction=0.1, vocab_size=VOCAB)


@pytest.mark.parametrize("columns", ["messages", "prompt-completion", "text"])
def test_a_saved_dataset_gives_the_corpus_of_its_rows_as_jsonl(tiny, tmp_path, columns):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny), local_files_only=True)
    rows = {"messages": ROWS, "prompt-completion": [{"prompt": t[:12], "completion": t[12:]} for t in TEXT],
            "text": [{"text": t, "source": "x"} for t in TEXT]}[columns]
    _dataset(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got, want = _corpus(tmp_path / "ds", tokenizer), _corpus(tmp_path / "rows.jsonl", tokenizer)
    assert torch.equal(got.train, want.train) and torch.equal(got.val, want.val)
    assert (got.train_labels is None) == (columns == "text") and (want.train_labels is None) == (columns == "text")
    if got.train_labels is not None:
        assert torch.equal(got.train_labels, want.train_labels) and torch.equal(got.val_labels, want.val_labels)
    datasets.DatasetDict({"train": _dataset(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert torch.equal(_corpus(tmp_path / "dd", tokenizer).train, want.train)


def test_bad_datasets_are_one_line(tiny, tmp_path, capsys):
    _dataset([{"question": "q"}] * 4).save_to_disk(str(tmp_path / "nocol"))
    err = cli_error(capsys, ["train", "--model", f"hf:{tiny}", "--data", str(tmp_path / "nocol"), "--steps", "1",
                             "--quiet"])
    assert "nocol: no 'text', 'messages' or 'prompt' and 'completion' column (columns: question)" in err
    bad = [dict(r) for r in ROWS[:3]] + [{"messages": [{"role": "narrator", "content": "x"}]}]
    _dataset(bad).save_to_disk(str(tmp_path / "badrole"))
    err = cli_error(capsys, ["train", "--model", f"hf:{tiny}", "--data", str(tmp_path / "badrole"), "--steps", "1",
                             "--quiet"])
    assert "badrole row 3: message 0 has role 'narrator'" in err
    datasets.DatasetDict({"test": _dataset(ROWS)}).save_to_disk(str(tmp_path / "notrain"))
    err = cli_error(capsys, ["train", "--model", f"hf:{tiny}", "--data", str(tmp_path / "notrain"), "--steps", "1",
                             "--quiet"])
    assert "notrain: a DatasetDict without a 'train' split (splits: test)" in err
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"vocab_size": 256, "seq_len": 32, "layers": 2, "hidden": 32, "heads": 2}))
    err = cli_error(capsys, ["train", "--model", str(model), "--data", str(tmp_path / "ds"), "--steps", "1", "--quiet"])
    assert "datasets directories) need a model with a tokenizer" in err and str(tmp_path / "ds") in err


def test_resume_gives_the_uninterrupted_batches(tiny, tmp_path):
    _dataset(ROWS).save_to_disk(str(tmp_path / "ds"))

    def config(ckpt: bool, resume: bool = False) -> TrainConfig:
        return TrainConfig(
            model=ModelOptions(model=f"hf:{tiny}"),
            data=DataOptions(data=[str(tmp_path / "ds")], batch=2, seq=16),
            optim=OptimOptions(lr=3e-3, warmup=2),
            runtime=RuntimeConfig(window=2, clip_grad_norm=1.0),
            run=RunOptions(steps=4, log_every=2, eval_every=2, eval_batches=2, quiet=True),
            checkpoint=CheckpointOptions(checkpoint_dir=str(tmp_path / "ck") if ckpt else None, checkpoint_every=2 if ckpt else 0,
                                         resume=resume))

    straight = run_training(config(False))
    run_training(config(True))
    shutil.rmtree(tmp_path / "ck" / "step-00000004")
    resumed = run_training(config(True, resume=True))
    assert resumed.start_step == 2
    assert resumed.losses == straight.losses[2:] and resumed.val_losses[-1] == straight.val_losses[-1]
