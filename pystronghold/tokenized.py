"""Token data: what ``--data`` gives a model, as token ids (and loss labels).

``data_files`` lists what ``--data`` names: a file as it is, a ``datasets`` directory whole, any
other directory as every file under it in sorted path order (hidden entries, ``data.SKIP_DIRS``
and links to directories are not read, and counted), each by format: a token file (``.bin``/``.npy``), ``.jsonl`` records,
or text (UTF-8 without NUL bytes, judged by the first ``SNIFF_BYTES``). A file of none of these in a
directory is refused, named, rather than skipped. ``training_corpus`` logs what it reads and picks
the reader: a token file alone (memory-mapped by ``token_files``), bytes for a GPT preset or JSON
model (``data.load_corpus``; text only), or ``tokenized_corpus`` for a model with its own tokenizer
(``load_tokenizer(DIR)``, local files only): records (``pystronghold.records``) packed one after
the other, then the text files tokenized as one stream. The last ``val_fraction`` of the tokens is
validation; ``max_bytes`` bounds the text read (UTF-8 bytes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pystronghold.data import IGNORE_INDEX, SKIP_DIRS, VOCAB_SIZE, Corpus, DataConfig, load_corpus, split_range
from pystronghold.options import ConfigError, first_line
from pystronghold.records import (dataset_records, encode_record, encode_text, is_dataset_dir, jsonl_records,
                                  record_bytes)
from pystronghold.token_files import TOKEN_FILE_SUFFIXES, token_file_corpus

__all__ = ["training_corpus", "load_tokenizer", "has_tokenizer", "tokenized_corpus", "TOKENIZER_FILES", "DataFile",
           "data_files", "SNIFF_BYTES"]

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


# ---- what --data names

SNIFF_BYTES = 8192
"""Leading bytes of a file inside a directory that decide whether it is text."""
FORMATS = ("text", "jsonl", "dataset", "tokens")
"""``DataFile.format`` values."""


@dataclass(frozen=True, slots=True)
class DataFile:
    """One source of ``--data``."""

    path: str
    format: str
    """One of ``FORMATS``: text, JSONL records, a datasets directory, or a token file."""
    size: int
    """Bytes on disk (a datasets directory: its files' total)."""


def _names(paths: list[str], most: int = 5) -> str:
    return ", ".join(paths[:most]) + (f" and {len(paths) - most} more" if len(paths) > most else "")


def _is_text(path: Path) -> bool:
    """UTF-8 without NUL bytes in the first ``SNIFF_BYTES`` (a character cut at the end is fine)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data" and len(head) == SNIFF_BYTES
    return True


def _format(path: Path, *, named: bool) -> str | None:
    """The format of file ``path``; a file named directly is text unless its suffix says otherwise,
    one inside a directory must look like text (None: it does not)."""
    if path.suffix in TOKEN_FILE_SUFFIXES:
        return "tokens"
    if path.suffix == ".jsonl":
        return "jsonl"
    return "text" if named or _is_text(path) else None


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def data_files(paths: list[str]) -> tuple[list[DataFile], int]:
    """The sources of ``--data paths`` in order (see the module docstring), and how many hidden or
    ``SKIP_DIRS`` entries inside directories were not read. ConfigError (one line) naming the files
    of a directory that are of no supported format, or a directory with no file to read."""
    out: list[DataFile] = []
    skipped = 0
    for p in paths:
        root = Path(p)
        if is_dataset_dir(root):
            out.append(DataFile(str(root), "dataset", _tree_size(root)))
            continue
        if not root.is_dir():
            out.append(DataFile(str(root), _format(root, named=True), root.stat().st_size))
            continue
        found, unsupported = [], []
        for dirpath, dirnames, filenames in os.walk(root):
            # NOTE: a link to a directory is not followed (os.walk's default: no loops), and counted
            keep = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                          and not Path(dirpath, d).is_symlink())
            skipped += len(dirnames) - len(keep)
            dirnames[:] = []
            for name in keep:  # a datasets directory inside is one source, not its files
                sub = Path(dirpath, name)
                if is_dataset_dir(sub):
                    found.append(DataFile(str(sub), "dataset", _tree_size(sub)))
                else:
                    dirnames.append(name)
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if name.startswith("."):
                    skipped += 1
                elif path.is_file():
                    kind = _format(path, named=False)
                    if kind is None:
                        unsupported.append(str(path))
                    else:
                        found.append(DataFile(str(path), kind, path.stat().st_size))
        if unsupported:
            raise ConfigError(f"--data {p}: {len(unsupported)} file(s) are neither text (UTF-8), .jsonl records nor "
                              f"token files (.bin, .npy) and would be skipped: {_names(unsupported)}; move them "
                              "out or name the files to read")
        if not found:
            raise ConfigError(f"--data {p}: the directory has no file to read (hidden files and "
                              f"{', '.join(sorted(SKIP_DIRS))} are not read)")
        out += sorted(found, key=lambda f: f.path)
    return out, skipped


def _describe(files: list[DataFile], skipped: int) -> str:
    """The start-up line of what ``--data`` reads."""
    counts = {k: sum(f.format == k for f in files) for k in FORMATS}
    kinds = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    return (f"--data: {len(files)} source(s) ({kinds}), {sum(f.size for f in files)} bytes on disk"
            + (f"; {skipped} entries not read (hidden, {'/'.join(sorted(SKIP_DIRS))}, links to directories)"
               if skipped else ""))


def training_corpus(paths: list[str], *, vocab_size: int, max_bytes: int, val_fraction: float,
                    token_dtype: str = "auto", tokenizer_dir: str | os.PathLike | None = None) -> Corpus:
    """The corpus of ``--data paths`` (none: the standard library's sources) for a model of
    ``vocab_size`` entries (see the module docstring); ``tokenizer_dir``: the model's own tokenizer
    (None: the model reads bytes). ConfigError (one line) for sources that cannot be read together:
    a token file with anything else, records for a byte-level model."""
    files, skipped = data_files(paths)
    if files:
        log.info("%s", _describe(files, skipped))
    tokens = [f.path for f in files if f.format == "tokens"]
    if tokens:
        if len(files) != 1:
            raise ConfigError("--data: a token file (.bin, .npy) is trained on alone and mixes with nothing, but "
                              f"{len(files)} sources were given: {_names([f.path for f in files])}")
        return token_file_corpus(tokens[0], vocab_size=vocab_size, val_fraction=val_fraction, token_dtype=token_dtype)
    if tokenizer_dir is not None:
        return tokenized_corpus([f.path for f in files], load_tokenizer(tokenizer_dir), max_bytes=max_bytes,
                                val_fraction=val_fraction, vocab_size=vocab_size)
    records = [f.path for f in files if f.format != "text"]
    if records:
        raise ConfigError(f"--data: records (.jsonl files, datasets directories) need a model with a tokenizer "
                          f"(--model hf:DIR); byte-level models read text files: {_names(records)}")
    if vocab_size < VOCAB_SIZE:
        raise ConfigError(f"--model: vocab_size {vocab_size} is smaller than the {VOCAB_SIZE} byte values of the data")
    return load_corpus(DataConfig(paths=[f.path for f in files], max_bytes=max_bytes, val_fraction=val_fraction))


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
    log.info("corpus: %d train tokens, %d validation tokens from %d file(s)%s%s", len(train), len(val), len(files),
             f", {int((labels[:cut] != IGNORE_INDEX).sum())} train targets" if masked else "",
             f"; max_bytes {max_bytes} reached: {len(paths) - len(files)} of {len(paths)} sources not read"
             if len(files) < len(paths) else "")
    return Corpus(train=train, val=val, train_files=files, val_files=files[-1:],
                  train_labels=labels[:cut] if masked else None, val_labels=labels[cut:] if masked else None,
                  unit="token")

