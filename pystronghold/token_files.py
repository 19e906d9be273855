"""Pre-tokenized data: one flat file of token ids, memory-mapped, never read whole.

``.bin``: raw little-endian ids, ``token_dtype`` "uint16", "uint32" or "auto" (uint16 when the
vocabulary has at most 65536 entries); ``.npy``: a 1-D integer array, its header's dtype.
``BatchSampler`` reads only the pages of the windows it draws; ids are checked against the
vocabulary in chunks of ``CHECK_CHUNK``. The last ``val_fraction`` of the tokens is validation.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from pystronghold.data import Corpus, split_range
from pystronghold.options import ConfigError, first_line

__all__ = ["TOKEN_FILE_SUFFIXES", "TOKEN_DTYPES", "is_token_file", "open_token_file", "token_file_corpus"]

log = logging.getLogger(__name__)

TOKEN_FILE_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("auto", "uint16", "uint32")
"""Values of ``--token-dtype``."""
CHECK_CHUNK = 1 << 24
"""Tokens per chunk of the vocabulary check (64 MiB of uint32)."""


def is_token_file(path: str | Path) -> bool:
    """Whether ``path`` is a file named as a token file (``TOKEN_FILE_SUFFIXES``)."""
    path = Path(path)
    return path.suffix in TOKEN_FILE_SUFFIXES and path.is_file()


def open_token_file(path: str | Path, *, vocab_size: int, token_dtype: str = "auto") -> np.ndarray:
    """The ids of ``path``, a read-only (N,) memory map; ValueError (one line) for a file that is
    empty, ragged, not 1-D integer, or holds an id outside [0, vocab_size)."""
    path = Path(path)
    if token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"--token-dtype must be one of {', '.join(TOKEN_DTYPES)}, got {token_dtype!r}")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a .npy array ({first_line(e)})") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"{path}: a token file must hold a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if token_dtype != "auto" and tokens.dtype != np.dtype(token_dtype):
            raise ValueError(f"{path}: its header says {tokens.dtype}, --token-dtype says {token_dtype}; "
                             "leave --token-dtype auto for .npy files")
    else:
        dtype = np.dtype(token_dtype if token_dtype != "auto" else "uint16" if vocab_size <= 1 << 16 else "uint32")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {dtype} ids; is --token-dtype right?")
        tokens = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r") if size else np.empty(0, dtype)
    if len(tokens) == 0:
        raise ValueError(f"{path}: the token file is empty")
    for start in range(0, len(tokens), CHECK_CHUNK):
        chunk = tokens[start:start + CHECK_CHUNK]
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise ValueError(f"{path}: token id {bad} near position {start}, but the model's vocabulary has "
                             f"{vocab_size} entries; the file was tokenized for another model")
    return tokens


def token_file_corpus(path: str | Path, *, vocab_size: int, val_fraction: float,
                      token_dtype: str = "auto") -> Corpus:
    """Training and validation ids of one token file: two memory-mapped ranges (the last
    ``val_fraction`` is validation)."""
    tokens = open_token_file(path, vocab_size=vocab_size, token_dtype=token_dtype)
    train, val = split_range(tokens, val_fraction, where=f"{path}: ",
                             remedy="give a longer file or another --val-fraction")
    log.info("corpus: %d train tokens, %d validation tokens from %s (%s, memory-mapped)", len(train), len(val),
             path, tokens.dtype)
    return Corpus(train=train, val=val, train_files=[str(path)], val_files=[str(path)], unit="token")
