"""`--data DIR` reads every file of a supported format under DIR (text, .jsonl records, a token
file), in sorted path order, or refuses in one line naming what it would skip or cannot mix; the
start-up line says what is read."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from pystronghold.cli import main
from pystronghold.tokenized import data_files, training_corpus
from hf_models import TEXT, VOCAB, save_tiny, save_tokenizer
from train_helpers import cli_error


def _records(path, i: int) -> None:
    path.write_text("".join(json.dumps({"text": f"def g{k}_{i}(x):\n    return x + {k}\n"}) + "\n" for k in range(40)))


@pytest.fixture
def mixed(tmp_path):
    """One .py file and three .jsonl files."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.py").write_text("".join(TEXT))
    for i in range(3):
        _records(folder / f"r{i}.jsonl", i)
    return folder


def _corpus(paths, **kw):
    return training_corpus([str(p) for p in paths], max_bytes=1 << 16, val_fraction=0.1, **kw)


def test_a_mixed_folder_reads_every_file_as_if_each_were_named(tmp_path, mixed, caplog):
    pytest.importorskip("transformers")
    save_tokenizer(tmp_path / "tok")
    with caplog.at_level(logging.INFO, logger="pystronghold.tokenized"):
        folder = _corpus([mixed], vocab_size=VOCAB, tokenizer_dir=tmp_path / "tok")
    named = _corpus(sorted(mixed.iterdir()), vocab_size=VOCAB, tokenizer_dir=tmp_path / "tok")
    assert torch.equal(torch.cat([folder.train, folder.val]), torch.cat([named.train, named.val]))
    assert sorted(folder.train_files) == sorted(str(p) for p in mixed.iterdir())
    size = sum(p.stat().st_size for p in mixed.iterdir())
    assert f"--data: 4 source(s) (1 text, 3 jsonl), {size} bytes on disk" in caplog.text


def test_a_jsonl_folder_trains(tmp_path):
    pytest.importorskip("transformers")
    directory = save_tiny(tmp_path, "llama")
    folder = tmp_path / "records"
    folder.mkdir()
    for i in range(3):
        _records(folder / f"r{i}.jsonl", i)
    assert main(["train", "--model", f"hf:{directory}", "--data", str(folder), "--steps", "1", "--batch", "2",
                 "--seq", "16", "--eval-every", "0", "--eval-batches", "1", "--quiet"]) == 0


def test_a_byte_level_model_reads_every_text_file_and_refuses_records(tmp_path, mixed, capsys):
    text = tmp_path / "text"
    text.mkdir()
    (text / "notes.txt").write_text("plain notes\n" * 200)
    (text / "b.py").write_text("".join(TEXT))
    corpus = _corpus([text], vocab_size=256)
    assert corpus.train_files == [str(text / "b.py"), str(text / "notes.txt")]  # sorted, .txt included
    err = cli_error(capsys, ["train", "--data", str(mixed), "--steps", "1", "--quiet"])
    assert "records (.jsonl files, datasets directories) need a model with a tokenizer" in err
    assert all(str(mixed / f"r{i}.jsonl") in err for i in range(3))


def test_files_of_no_supported_format_are_named_not_skipped(tmp_path, capsys):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("text\n" * 100)
    (folder / "sub" / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (folder / "sub" / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 10)
    err = cli_error(capsys, ["train", "--data", str(folder), "--steps", "1", "--quiet"])
    assert f"--data {folder}: 2 file(s) are neither text (UTF-8), .jsonl records nor token files (.bin, .npy) " \
           f"and would be skipped: {folder / 'sub' / 'latin1.txt'}, {folder / 'sub' / 'picture.png'}" in err


def test_a_token_file_does_not_mix_with_other_files(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    np.save(folder / "t.npy", np.arange(1000, dtype=np.uint16) % 256)
    assert _corpus([folder], vocab_size=256).unit == "token"  # a folder of one token file is that file
    (folder / "notes.txt").write_text("text\n" * 100)
    err = cli_error(capsys, ["train", "--data", str(folder), "--steps", "1", "--quiet"])
    assert "a token file (.bin, .npy) is trained on alone and mixes with nothing, but 2 sources were given: " \
           f"{folder / 'notes.txt'}, {folder / 't.npy'}" in err


def test_hidden_entries_and_bytecode_are_counted_not_read_and_an_empty_folder_is_refused(tmp_path, capsys):
    folder = tmp_path / "data"
    for d in (".git", "__pycache__", "b"):
        (folder / d).mkdir(parents=True)
    (folder / ".git" / "HEAD").write_bytes(b"\0binary")
    (folder / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0\0")
    (folder / ".env").write_text("SECRET=1\n")
    (folder / "b" / "z.txt").write_text("z\n")
    (folder / "a.txt").write_text("a\n")
    (folder / "link").symlink_to(folder / "b")  # not followed (a link may loop)
    files, skipped = data_files([str(folder)])
    assert [f.path for f in files] == [str(folder / "a.txt"), str(folder / "b" / "z.txt")] and skipped == 4
    empty = tmp_path / "empty"
    (empty / ".git").mkdir(parents=True)
    assert "the directory has no file to read" in cli_error(capsys, ["train", "--data", str(empty), "--steps", "1"])
