"""Training records (JSONL lines or rows of a ``datasets`` directory) as token ids and loss labels.

A record is ``{"text"}`` (every token a target, then end-of-sequence), ``{"messages"}`` (rendered
with the tokenizer's chat template; only assistant turns are targets) or ``{"prompt",
"completion"}`` (only the completion and end-of-sequence are targets). ``encode_record`` returns
the ids and labels (``data.IGNORE_INDEX`` where no loss is taken), as TRL's SFT trainer builds
them. The text is tokenized once; a token is a target when it starts inside a target span.
Errors are one-line ValueErrors naming the file and line (or row).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

from pystronghold.data import IGNORE_INDEX
from pystronghold.extras import require
from pystronghold.options import first_line

__all__ = ["ROLES", "jsonl_records", "dataset_records", "is_dataset_dir", "require_data", "encode_record", "encode_text",
           "record_bytes"]

ROLES = ("system", "user", "assistant", "tool", "developer")
"""Roles a message may have."""

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of each non-blank line of a JSONL file; ``where`` is "PATH line N"."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
                yield where, record
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None


def is_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk`` (a Dataset or a
    DatasetDict)."""
    return path.is_dir() and ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def require_data(path) -> None:
    """ValueError (one line, with the pip line) when ``datasets``, which reads the directory
    ``path``, is not installed."""
    try:
        require("data", f"--data {path} (a datasets save_to_disk directory)")
    except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
        raise ValueError(str(e)) from None


def dataset_records(path: Path) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of each row of a ``save_to_disk`` directory (a DatasetDict: its "train"
    split), memory-mapped by ``datasets``; ``where`` is "PATH row N" (from 0)."""
    require_data(path)
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: cannot load the datasets directory ({first_line(e)})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(dataset)})")
        dataset = dataset["train"]
    columns = set(dataset.column_names)
    if not ({"text"} <= columns or {"messages"} <= columns or {"prompt", "completion"} <= columns):
        raise ValueError(f"{path}: no 'text', 'messages' or 'prompt' and 'completion' column "
                         f"(columns: {', '.join(sorted(columns))})")
    for number, row in enumerate(dataset):
        yield f"{path} row {number}", row


def record_bytes(record: dict) -> int:
    """UTF-8 bytes of the strings a record holds (what ``max_bytes`` budgets)."""
    if isinstance(record.get("messages"), list):
        return sum(len(str(m.get("content", "")).encode()) for m in record["messages"] if isinstance(m, dict))
    return sum(len(record[k].encode()) for k in ("text", "prompt", "completion") if isinstance(record.get(k), str))


def encode_record(tokenizer, record: dict, where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels (same length) of one record (see the module docstring)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if "messages" in record:
        return _encode_messages(tokenizer, record["messages"], where)
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise ValueError(f'{where}: expected a "{key}" string beside the '
                                 f'"{"completion" if key == "prompt" else "prompt"}"')
        ids, labels = _encode_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))])
        return ids + eos, labels + eos
    if isinstance(record.get("text"), str):
        ids = encode_text(tokenizer, record["text"]) + eos
        return ids, list(ids)
    raise ValueError(f'{where}: expected an object with a "text" string, "messages", or "prompt" and '
                     f'"completion" (keys: {", ".join(record) or "none"})')


# ---- conversations

def _encode_messages(tokenizer, messages, where: str) -> tuple[list[int], list[int]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}: message {i} must be an object with a "content" string')
        if m.get("role") not in ROLES:
            raise ValueError(f"{where}: message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{where}: messages need a chat template and the model's tokenizer has none; set "
                         "tokenizer.chat_template and save it, or give text records")
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        try:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        except Exception as e:  # a template's own error (jinja raise_exception) or the tokenizer's
            raise ValueError(f"{where}: the chat template failed ({first_line(e)})") from None
        ids = list(out["input_ids"])
        return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, out["assistant_masks"])]
    render = _renderer(tokenizer, where)
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(f"{where}: the chat template does not render the conversation prefix by prefix, so "
                             "the assistant's tokens cannot be found; add {% generation %} markers to it")
        spans.append((len(before), len(through)))
    return _encode_spans(tokenizer, text, spans)


def _renderer(tokenizer, where: str):
    def render(messages: list, generation_prompt: bool) -> str:
        if not messages:
            return ""
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # a template's own error (jinja raise_exception, a missing key)
            raise ValueError(f"{where}: the chat template failed ({first_line(e)})") from None
    return render


# ---- tokens of text spans

def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, without the special tokens the tokenizer would add around it."""
    return _tokenize(tokenizer, text)["input_ids"]


def _tokenize(tokenizer, text: str, **kwargs):
    # NOTE: verbose=False: a corpus is longer than the model's context by design (it is cut into
    # windows afterwards); the "sequence length is longer than" warning would be noise.
    return tokenizer(text, add_special_tokens=False, verbose=False, **kwargs)


def _encode_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Ids of ``text`` and labels: the id for a token starting inside one of ``spans`` (character
    ranges), ``IGNORE_INDEX`` otherwise."""
    if getattr(tokenizer, "is_fast", False):
        out = _tokenize(tokenizer, text, return_offsets_mapping=True)
        ids = list(out["input_ids"])
        inside = [any(a <= start < b for a, b in spans) for start, _ in out["offset_mapping"]]
        return ids, [t if keep else IGNORE_INDEX for t, keep in zip(ids, inside)]
    ids, labels, at = [], [], 0  # no offsets: each piece between span edges is encoded alone
    for a, b in spans + [(len(text), len(text))]:
        for piece, keep in ((text[at:a], False), (text[a:b], True)):
            if piece:
                got = encode_text(tokenizer, piece)
                ids += got
                labels += got if keep else [IGNORE_INDEX] * len(got)
        at = b
    return ids, labels
