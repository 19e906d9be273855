"""The unit of the loss: nats per byte for byte-level text, nats per token for a tokenizer's or a
token file's ids; ``loss.png``'s axis says which (``Corpus.unit``, ``pictures.loss_axis_label``)."""

from __future__ import annotations

import numpy as np
import pytest

from pystronghold.tokenized import training_corpus
from pystronghold.train import pictures
from hf_models import TEXT, VOCAB, save_tokenizer


def _corpus(paths, **kw):
    return training_corpus([str(p) for p in paths], max_bytes=1 << 16, val_fraction=0.1, **kw)


def test_the_corpus_says_bytes_for_text_and_tokens_for_ids(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("".join(TEXT))
    assert _corpus([text], vocab_size=256).unit == "byte"
    np.save(tmp_path / "t.npy", np.arange(1000, dtype=np.uint16) % 256)
    assert _corpus([tmp_path / "t.npy"], vocab_size=256).unit == "token"
    pytest.importorskip("transformers")
    save_tokenizer(tmp_path / "tok")
    assert _corpus([text], vocab_size=VOCAB, tokenizer_dir=tmp_path / "tok").unit == "token"


def test_the_loss_axis_names_the_unit(tmp_path, monkeypatch):
    assert pictures.loss_axis_label("byte") == "cross-entropy (nats/byte)"
    assert pictures.loss_axis_label("token") == "cross-entropy (nats/token)"
    with pytest.raises(ValueError, match="unit must be"):
        pictures.loss_axis_label("word")
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    labels = []
    set_ylabel = Axes.set_ylabel
    monkeypatch.setattr(Axes, "set_ylabel", lambda self, label, *a, **k: labels.append(label) or set_ylabel(
        self, label, *a, **k))
    pictures.write_loss_png(tmp_path / "loss.png", [(1, 3.0), (2, 2.5)], [(2, 2.6)], unit="token")
    assert labels == ["cross-entropy (nats/token)"] and (tmp_path / "loss.png").stat().st_size > 0
