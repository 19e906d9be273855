"""Byte-level corpus and batch sampler: determinism, resume, disjoint splits, bad paths."""

import pytest
import torch

from pystronghold.data import (BatchSampler, DataConfig, default_paths, load_corpus,
                               validation_batches)


@pytest.fixture
def text_dir(tmp_path):
    for i in range(30):
        sub = tmp_path / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:02d}.txt").write_bytes(bytes([65 + i % 26]) * (100 + 7 * i))
    (tmp_path / "skip.bin").write_bytes(b"\x00" * 50)
    return tmp_path


def test_stdlib_default_is_bounded_and_deterministic():
    cfg = DataConfig(max_bytes=200_000)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert len(a.train) + len(a.val) == 200_000
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert all(f.startswith(default_paths()[0]) and f.endswith(".py") for f in a.train_files)
    assert not any("site-packages" in f for f in a.train_files)
    assert b"def " in bytes(a.train[:100_000].tolist())


def test_range_split_is_two_disjoint_ranges(text_dir):
    cfg = DataConfig(paths=[str(text_dir)], suffixes=(".txt",), val_fraction=0.25)
    c = load_corpus(cfg)
    everything = b"".join(open(f, "rb").read() + b"\n" for f in sorted(text_dir.glob("d*/*.txt")))
    assert bytes(torch.cat([c.train, c.val]).tolist()) == everything
    assert len(c.val) == int(len(everything) * 0.25)
    assert "skip.bin" not in " ".join(c.train_files + c.val_files)


def test_file_split_is_disjoint_by_file(text_dir):
    c = load_corpus(DataConfig(paths=[str(text_dir)], suffixes=(".txt",), val_fraction=0.3, split="file"))
    assert c.val_files and c.train_files
    assert not set(c.train_files) & set(c.val_files)
    assert len(c.train) == sum(len(open(f, "rb").read()) + 1 for f in c.train_files)
    # the same files go to validation when other files are added
    (text_dir / "d0" / "new.txt").write_bytes(b"zz" * 40)
    again = load_corpus(DataConfig(paths=[str(text_dir)], suffixes=(".txt",), val_fraction=0.3, split="file"))
    assert set(c.val_files) <= set(again.val_files)


def test_max_bytes_caps_what_is_read(text_dir):
    c = load_corpus(DataConfig(paths=[str(text_dir)], suffixes=(".txt",), max_bytes=1000))
    assert len(c.train) + len(c.val) == 1000


def test_missing_path_is_named():
    with pytest.raises(FileNotFoundError, match="/no/such/corpus"):
        DataConfig(paths=["/no/such/corpus"])


def test_bad_config_fields():
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="split"):
        DataConfig(split="random")
    with pytest.raises(ValueError, match="max_bytes"):
        DataConfig(max_bytes=0)


def _data(n=5000):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


def test_batches_are_shifted_windows_and_deterministic():
    data = _data()
    s1, s2 = BatchSampler(data, 4, 16, seed=7), BatchSampler(data, 4, 16, seed=7)
    for _ in range(5):
        (x1, y1), (x2, y2) = s1.next_batch(), s2.next_batch()
        assert x1.shape == (4, 16) and x1.dtype == torch.int64
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])
    other = BatchSampler(data, 4, 16, seed=8).next_batch()[0]
    assert not torch.equal(other, BatchSampler(data, 4, 16, seed=7).next_batch()[0])


def test_an_epoch_visits_disjoint_windows():
    data = torch.arange(170, dtype=torch.int64).to(torch.uint8)  # values are positions
    s = BatchSampler(data, 1, 16, seed=0)
    n = len(s._starts)
    firsts = [int(s.next_batch()[0][0, 0]) for _ in range(n)]
    assert len(set(firsts)) == n and s.epoch == 0
    s.next_batch()
    assert s.epoch == 1


def test_resume_sees_the_batches_of_the_uninterrupted_run():
    data = _data(3000)
    full = BatchSampler(data, 3, 32, seed=1)
    reference = [full.next_batch() for _ in range(70)]  # crosses several epochs
    part = BatchSampler(data, 3, 32, seed=1)
    for _ in range(41):
        part.next_batch()
    state = part.state_dict()
    resumed = BatchSampler(data, 3, 32, seed=99)  # the seed comes from the state
    resumed.load_state_dict(state)
    for k in range(41, 70):
        x, y = resumed.next_batch()
        assert torch.equal(x, reference[k][0]) and torch.equal(y, reference[k][1])


def test_resume_refuses_other_shapes():
    s = BatchSampler(_data(), 2, 8)
    with pytest.raises(ValueError, match="saved for"):
        BatchSampler(_data(), 2, 9).load_state_dict(s.state_dict())


def test_validation_batches_are_fixed():
    data = _data(2000)
    a, b = validation_batches(data, 4, 16, 3), validation_batches(data, 4, 16, 3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(xa[:, 1:], ya[:, :-1])
    assert len(validation_batches(data[:40], 4, 16, 3)) == 1  # two windows: one smaller batch
