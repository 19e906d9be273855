"""Token files (.bin, .npy): memory-mapped, never read whole, ids checked against the vocabulary;
training on them (GPT and hf models), and exact resume in every data format."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pystronghold.data import BatchSampler, validation_batches
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.token_files import open_token_file, token_file_corpus
from pystronghold.train.config import CheckpointOptions, DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import TEXT, VOCAB, save_tiny, set_chat_template
from train_helpers import TINY, cli_error, run_training


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("suffix, dtype, flag", [(".bin", np.uint16, "auto"), (".bin", np.uint32, "uint32"),
                                                 (".npy", np.uint32, "auto"), (".npy", np.int64, "auto")])
def test_token_file_is_a_map_of_the_file(tmp_path, suffix, dtype, flag):
    """The corpus is two ranges of a read-only map of the file (no copy); the sampler's windows are
    the file's ids."""
    ids = np.arange(5000).astype(dtype)  # distinct ids: a window's first id is its start
    path = tmp_path / f"tokens{suffix}"
    ids.tofile(path) if suffix == ".bin" else np.save(path, ids)
    corpus = token_file_corpus(path, vocab_size=5000, val_fraction=0.1, token_dtype=flag)
    for part in (corpus.train, corpus.val):
        assert isinstance(part, np.memmap) and not part.flags.writeable
        assert str(part.filename) == str(path.resolve()) and part.dtype == dtype
    assert np.array_equal(np.concatenate([corpus.train, corpus.val]), ids) and len(corpus.val) == 500
    x, y = BatchSampler(corpus.train, 4, 16, seed=1).next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == (4, 16)
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        assert torch.equal(row_x, torch.arange(start, start + 16)) and torch.equal(row_y, row_x + 1)
    assert len(validation_batches(corpus.val, 2, 16, 2)) == 2


def test_opening_a_large_file_does_not_read_it_into_memory(tmp_path):
    """A 64 MiB uint16 file: opening, checking every id and drawing batches leave the process's
    anonymous memory (its heap) far below the file's size; the file's pages are the page cache's."""
    path = tmp_path / "big.bin"
    n = 32 << 20
    with open(path, "wb") as f:
        block = (np.arange(1 << 20) % 250).astype(np.uint16)
        for _ in range(n >> 20):
            block.tofile(f)
    before = _rss_anon_bytes()
    corpus = token_file_corpus(path, vocab_size=256, val_fraction=0.01)
    sampler = BatchSampler(corpus.train, 8, 64, seed=0)
    for _ in range(10):
        sampler.next_batch()
    grew = _rss_anon_bytes() - before
    assert len(corpus.train) + len(corpus.val) == n
    assert grew < (2 * n) // 4, f"anonymous memory grew by {grew} bytes for a {2 * n}-byte file"


def test_bad_token_files_are_one_line(tmp_path):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4], dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match=r"t.bin: token id 300 near position 0, but the model's vocabulary has 256"):
        open_token_file(path, vocab_size=256)
    path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"t.bin: 3 bytes is not a whole number of uint16 ids"):
        open_token_file(path, vocab_size=256)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"t.bin: the token file is empty"):
        open_token_file(path, vocab_size=256)
    np.save(tmp_path / "m.npy", np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match=r"m.npy: a token file must hold a 1-D integer array"):
        open_token_file(tmp_path / "m.npy", vocab_size=256)
    np.save(tmp_path / "n.npy", np.array([3, -1, 2], np.int32))
    with pytest.raises(ValueError, match=r"n.npy: token id -1"):
        open_token_file(tmp_path / "n.npy", vocab_size=256)
    np.save(tmp_path / "u.npy", np.arange(10, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"u.npy: its header says uint16, --token-dtype says uint32"):
        open_token_file(tmp_path / "u.npy", vocab_size=256, token_dtype="uint32")


def test_cli_refuses_an_id_beyond_the_vocabulary_and_a_mixed_data_list(tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    path = tmp_path / "t.bin"
    (np.arange(4000) % 257).astype(np.uint16).tofile(path)
    err = cli_error(capsys, ["train", "--model", str(model), "--data", str(path), "--steps", "1", "--quiet"])
    assert "t.bin: token id 256 near position 0, but the model's vocabulary has 256 entries" in err
    err = cli_error(capsys, ["train", "--model", str(model), "--data", str(path), str(model), "--steps", "1",
                             "--quiet"])
    assert "a token file (.bin, .npy) is trained on alone" in err


# ---- resume: each format gives the uninterrupted run's losses


def _config(tmp_path, model: str, data: str, *, ckpt: bool = False, resume: bool = False,
            **data_options) -> TrainConfig:
    return TrainConfig(
        model=ModelOptions(model=model),
        data=DataOptions(data=[data], max_bytes=1 << 16, batch=2, seq=16, **data_options),
        optim=OptimOptions(lr=3e-3, warmup=2),
        runtime=RuntimeConfig(window=2, clip_grad_norm=1.0, accumulation_steps=2),
        run=RunOptions(steps=4, log_every=2, eval_every=2, eval_batches=2, quiet=True),
        checkpoint=CheckpointOptions(checkpoint_dir=str(tmp_path / "ck") if ckpt else None,
                                     checkpoint_every=2 if ckpt else 0, resume=resume))


def _chat_data(tmp_path) -> str:
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for k, text in enumerate(TEXT):
            record = ({"messages": [{"role": "user", "content": text[:12]}, {"role": "assistant", "content": text[12:]}]}
                      if k % 2 else {"prompt": text[:12], "completion": text[12:]})
            f.write(json.dumps(record) + "\n")
    return str(data)


def _resumed_losses_equal(tmp_path, model: str, data: str, **data_options) -> None:
    """Steps 3..4 resumed from the step-2 checkpoint (the step-4 one deleted, as if killed) are the
    straight run's, bit for bit, and so is the final validation loss."""
    straight = run_training(_config(tmp_path, model, data, **data_options))
    run_training(_config(tmp_path, model, data, ckpt=True, **data_options))
    shutil.rmtree(tmp_path / "ck" / "step-00000004")
    resumed = run_training(_config(tmp_path, model, data, ckpt=True, resume=True, **data_options))
    assert resumed.start_step == 2
    assert resumed.losses == straight.losses[2:] and resumed.val_losses[-1] == straight.val_losses[-1]


@pytest.mark.parametrize("kind", ["bin-gpt", "npy-hf", "chat-hf"])
def test_resume_gives_the_uninterrupted_batches(tmp_path, kind):
    if kind == "bin-gpt":
        model = tmp_path / "model.json"
        model.write_text(json.dumps(TINY))
        data = tmp_path / "t.bin"
        (np.arange(6000) * 31 % 256).astype(np.uint32).tofile(data)
        _resumed_losses_equal(tmp_path, str(model), str(data), token_dtype="uint32")
        return
    directory = save_tiny(tmp_path, "llama")
    if kind == "npy-hf":
        np.save(tmp_path / "t.npy", (np.arange(6000) * 31 % VOCAB).astype(np.uint16))
        _resumed_losses_equal(tmp_path, f"hf:{directory}", str(tmp_path / "t.npy"))
    else:
        set_chat_template(directory)
        _resumed_losses_equal(tmp_path, f"hf:{directory}", _chat_data(tmp_path))
