"""Token data: what ``--data`` gives a model, as token ids (and loss labels).

``training_corpus`` picks the reader: a token file (``.bin``/``.npy``, memory-mapped by
``token_files``), bytes for a GPT preset or JSON model (``data.load_corpus``), or
``tokenized_corpus`` for a model with its own tokenizer (``load_tokenizer(DIR)``, local files
only). ``.jsonl`` files and ``datasets`` directories hold records (``pystronghold.records``)
packed one after the other; other paths are tokenized as one stream. The last ``val_fraction`` of
the tokens is validation; ``max_bytes`` bounds the text read (UTF-8 bytes).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pystronghold.data import IGNORE_INDEX, VOCAB_SIZE, Corpus, DataConfig, load_corpus, split_range
from pystronghold.options import first_line
from pystronghold.records import (dataset_records, encode_record, encode_text, is_dataset_dir, jsonl_records,
                                  record_bytes)
from pystronghold.token_files import is_token_file, token_file_corpus

__all__ = ["training_corpus", "load_tokenizer", "has_tokenizer", "tokenized_corpus", "TOKENIZER_FILES"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Any of these in a model directory means it has a tokenizer."""


def has_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a saved tokenizer (one of ``TOKENIZER_FILES``)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer saved in ``directory``; ValueError (one line) when there is none."""
    path = Path(directory)
    if not has_tokenizer(path):
        raise ValueError(f"{path}: no tokenizer in the model directory (none of {', '.join(TOKENIZER_FILES)}); "
                         "save one there with tokenizer.save_pretrained(DIR)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"{path}: reading its tokenizer needs transformers (pip install 'pystronghold[hf]')") from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: cannot load its tokenizer ({first_line(e)})") from None


def training_corpus(paths: list[str], *, vocab_size: int, max_bytes: int, val_fraction: float,
                    token_dtype: str = "auto", tokenizer_dir: str | os.PathLike | None = None) -> Corpus:
    """The corpus of ``--data paths`` for a model of ``vocab_size`` entries (see the module
    docstring); ``tokenizer_dir``: the model's own tokenizer (None: the model reads bytes)."""
    if any(is_token_file(p) for p in paths):
        if len(paths) != 1:
            raise ValueError("--data: a token file (.bin, .npy) is trained on alone; give one token file "
                             f"and nothing else (got {len(paths)} paths)")
        return token_file_corpus(paths[0], vocab_size=vocab_size, val_fraction=val_fraction, token_dtype=token_dtype)
    if tokenizer_dir is not None:
        return tokenized_corpus(paths, load_tokenizer(tokenizer_dir), max_bytes=max_bytes,
                                val_fraction=val_fraction, vocab_size=vocab_size)
    for p in paths:
        if is_dataset_dir(Path(p)):
            raise ValueError(f"--data {p}: a datasets directory needs a model with a tokenizer (--model hf:DIR); "
                             "byte-level models read text files")
    if vocab_size < VOCAB_SIZE:
        raise ValueError(f"--model: vocab_size {vocab_size} is smaller than the {VOCAB_SIZE} byte values of the data")
    return load_corpus(DataConfig(paths=paths, max_bytes=max_bytes, val_fraction=val_fraction))


def _is_record_source(path: str) -> bool:
    return (path.endswith(".jsonl") and os.path.isfile(path)) or is_dataset_dir(Path(path))


def _record_pieces(path: str, tokenizer, budget: int) -> tuple[list[list[int]], list[list[int]], int]:
    """Ids and labels of each record of ``path`` until ``budget`` UTF-8 bytes are read; and the bytes used."""
    records = dataset_records(Path(path)) if os.path.isdir(path) else jsonl_records(Path(path))
    ids, labels, used, seen = [], [], 0, False
    for where, record in records:
        seen = True
        if used >= budget:
            break
        if set(record) & {"messages", "prompt", "completion"}:
            size = record_bytes(record)
        else:  # a text record is cut at the budget
            text = record.get("text")
            if isinstance(text, str):
                record = dict(record, text=text.encode()[:budget - used].decode(errors="ignore"))
            size = record_bytes(record)
        got_ids, got_labels = encode_record(tokenizer, record, where)
        ids.append(got_ids)
        labels.append(got_labels)
        used += size
    if not seen:
        raise ValueError(f"{path}: no records (an empty file or dataset)")
    return ids, labels, used


def tokenized_corpus(paths: list[str], tokenizer, *, max_bytes: int, val_fraction: float,
                     vocab_size: int) -> Corpus:
    """Training and validation token ids ((N,) int64 each, and labels when some tokens are not
    targets) of ``paths`` (see the module docstring).

    ValueError when a token id is not below ``vocab_size`` (the tokenizer does not belong to the
    model), a split is too short, or the training split has no target.
    """
    pieces: list[list[int]] = []
    label_pieces: list[list[int]] = []
    files: list[str] = []
    budget = max_bytes
    text_paths = [p for p in paths if not _is_record_source(p)]
    for p in paths:
        if p in text_paths or budget <= 0:
            continue
        ids, labels, used = _record_pieces(p, tokenizer, budget)
        budget -= used
        files.append(p)
        pieces += ids
        label_pieces += labels
    if text_paths or not paths:
        if budget >= 2:
            corpus = load_corpus(DataConfig(paths=text_paths, max_bytes=budget, val_fraction=val_fraction))
            raw = torch.cat([corpus.train, corpus.val]).numpy().tobytes()
            pieces.append(encode_text(tokenizer, raw.decode(errors="replace")))
            label_pieces.append(pieces[-1])
            files += corpus.train_files + [f for f in corpus.val_files if f not in corpus.train_files]
    tokens = torch.tensor([t for piece in pieces for t in piece], dtype=torch.int64)  # (N,)
    labels = torch.tensor([t for piece in label_pieces for t in piece], dtype=torch.int64)  # (N,)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {int(tokens.max())}, but the model's vocabulary has "
                         f"{vocab_size} entries: the tokenizer does not belong to the model")
    train, val = split_range(tokens, val_fraction, remedy="give more text, a larger --max-bytes or --val-fraction")
    cut = len(train)
    masked = bool((labels == IGNORE_INDEX).any())
    if masked and not bool((labels[1:cut] != IGNORE_INDEX).any()):
        raise ValueError(f"the train split of {', '.join(files)} has no target token (no assistant turn or "
                         "completion): nothing to learn")
    log.info("corpus: %d train tokens, %d validation tokens from %d file(s)%s", len(train), len(val), len(files),
             f", {int((labels[:cut] != IGNORE_INDEX).sum())} train targets" if masked else "")
    return Corpus(train=train, val=val, train_files=files, val_files=files[-1:],
                  train_labels=labels[:cut] if masked else None, val_labels=labels[cut:] if masked else None,
                  unit="token")

