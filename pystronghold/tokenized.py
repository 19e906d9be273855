"""Token data for a model with its own tokenizer (``--model hf:DIR``): text files or JSONL, tokenized.

``load_tokenizer(DIR)`` reads the tokenizer saved beside the weights (``AutoTokenizer``, local files
only). ``tokenized_corpus`` reads the text and returns a ``pystronghold.data.Corpus`` of int64 token
ids, which ``BatchSampler`` and ``validation_batches`` cut into batches as they do bytes:

- a ``.jsonl`` file holds one JSON object per line with a ``"text"`` string; each text is tokenized
  alone and followed by the tokenizer's end-of-sequence token (when it has one);
- every other path (files, directories, or none: the Python standard library) is read as
  ``pystronghold.data.load_corpus`` reads it and tokenized as one stream.

The tokens of all paths are concatenated in the order given and split by range: the last
``val_fraction`` of them is validation. ``max_bytes`` bounds the text read (UTF-8 bytes).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from pystronghold.data import Corpus, DataConfig, load_corpus

__all__ = ["load_tokenizer", "has_tokenizer", "tokenized_corpus", "TOKENIZER_FILES"]

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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: cannot load its tokenizer ({first})") from None


def _jsonl_texts(path: Path, budget: int) -> tuple[list[str], int]:
    """The ``"text"`` of each line of ``path`` until ``budget`` UTF-8 bytes are read; and bytes used."""
    texts, used = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if used >= budget:
                    break
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {number}: not JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{path} line {number}: expected an object with a "text" string')
                text = record["text"].encode()[:budget - used].decode(errors="ignore")
                texts.append(text)
                used += len(text.encode())
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
    return texts, used


def _encode(tokenizer, text: str) -> list[int]:
    # NOTE: verbose=False: a corpus is longer than the model's context by design (it is cut into
    # windows afterwards); the "sequence length is longer than" warning would be noise.
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def tokenized_corpus(paths: list[str], tokenizer, *, max_bytes: int, val_fraction: float,
                     vocab_size: int) -> Corpus:
    """Training and validation token ids ((N,) int64 each) of ``paths`` (see the module docstring).

    ValueError when a token id is not below ``vocab_size`` (the tokenizer does not belong to the
    model) or a split is too short.
    """
    pieces: list[list[int]] = []
    files: list[str] = []
    budget = max_bytes
    text_paths = [p for p in paths if not (p.endswith(".jsonl") and os.path.isfile(p))]
    eos = tokenizer.eos_token_id
    for p in paths:
        if p in text_paths or budget <= 0:
            continue
        texts, used = _jsonl_texts(Path(p), budget)
        budget -= used
        files.append(p)
        for text in texts:
            pieces.append(_encode(tokenizer, text) + ([eos] if eos is not None else []))
    if text_paths or not paths:
        if budget >= 2:
            corpus = load_corpus(DataConfig(paths=text_paths, max_bytes=budget, val_fraction=val_fraction))
            raw = torch.cat([corpus.train, corpus.val]).numpy().tobytes()
            pieces.append(_encode(tokenizer, raw.decode(errors="replace")))
            files += corpus.train_files + [f for f in corpus.val_files if f not in corpus.train_files]
    tokens = torch.tensor([t for piece in pieces for t in piece], dtype=torch.int64)  # (N,)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {int(tokens.max())}, but the model's vocabulary has "
                         f"{vocab_size} entries: the tokenizer does not belong to the model")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    train, val = tokens[:cut], tokens[cut:]
    for part, t in (("train", train), ("val", val)):
        if len(t) < 2:
            raise ValueError(f"the {part} split has {len(t)} tokens; give more text, a larger --max-bytes "
                             "or --val-fraction")
    log.info("corpus: %d train tokens, %d validation tokens from %d file(s)", len(train), len(val), len(files))
    return Corpus(train=train, val=val, train_files=files, val_files=files[-1:])
