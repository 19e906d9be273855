"""Documents longer than the context are split into consecutive windows, not truncated: the
record's every token is in the stream, and an epoch of the sampler visits it window by window.
Packed records keep their behaviour: windows run across record boundaries (no position reset)."""

from __future__ import annotations

import json

import pytest
import torch

from pystronghold.data import BatchSampler
from pystronghold.records import encode_record
from pystronghold.tokenized import load_tokenizer, tokenized_corpus

pytest.importorskip("transformers")


def test_a_document_longer_than_the_context_is_split_not_truncated(tmp_path):
    from hf_models import save_tokenizer

    save_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    seq = 16
    long_doc = {"text": " ".join(f"def f{i}(x): return x + {i}" for i in range(60))}
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps(long_doc) + "\n" + json.dumps({"text": "def g(y): return y"}) + "\n")
    ids, _ = encode_record(tokenizer, long_doc, "")
    assert len(ids) > 20 * (seq + 1)
    corpus = tokenized_corpus([str(data)], tokenizer, max_bytes=1 << 20, val_fraction=0.05, vocab_size=1 << 16)
    stream = torch.cat([corpus.train, corpus.val]).tolist()
    assert stream[:len(ids)] == ids  # every token of the long record, in order: nothing cut at T
    train = corpus.train.tolist()
    sampler = BatchSampler(corpus.train, 1, seq, seed=5)
    windows = (len(train) - seq) // (seq + 1)  # an epoch has this many windows (or one more)
    starts = []
    for _ in range(windows):
        x, y = sampler.next_batch()
        i = next(i for i in range(len(train) - seq) if train[i:i + seq] == x[0].tolist())
        assert y[0].tolist() == train[i + 1:i + seq + 1]
        starts.append(i)
    starts.sort()
    assert len(set(starts)) == windows  # the epoch's windows are distinct ...
    assert all(b - a == seq + 1 for a, b in zip(starts, starts[1:]))  # ... and consecutive: no gap, no cut
