"""Chat and prompt/completion records: loss labels on the assistant's and the completion's tokens only,
packed into one stream whose labels the sampler cuts with the tokens; one-line errors naming the line."""

from __future__ import annotations

import json

import pytest
import torch

from pystronghold.data import IGNORE_INDEX, BatchSampler, validation_batches
from pystronghold.records import encode_record
from pystronghold.tokenized import tokenized_corpus
from hf_models import CHAT_TEMPLATE, CHAT_TEMPLATE_MARKED, VOCAB, save_tiny, set_chat_template
from train_helpers import cli_error

CONVERSATION = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "def f0(x):"},
                {"role": "assistant", "content": "    return x * 0 + 1"},
                {"role": "user", "content": "and f1?"},
                {"role": "assistant", "content": "    return x * 1 + 1  # hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama directory (tokenizer without a chat template)."""
    return save_tiny(tmp_path_factory.mktemp("chat"), "llama")


def _targets(labels: list[int]) -> list[int]:
    return [t for t in labels if t != IGNORE_INDEX]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, CHAT_TEMPLATE_MARKED], ids=["prefix", "generation-markers"])
def test_only_the_assistant_turns_are_targets(tiny, template):
    """Both ways of finding the assistant's tokens (rendering prefix by prefix; the template's
    {% generation %} markers) give the ids of the rendered conversation tokenized whole, and labels
    that keep exactly the assistant turns with their end of turn."""
    tokenizer = set_chat_template(tiny, template)
    ids, labels = encode_record(tokenizer, {"messages": CONVERSATION}, "x line 1")
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(labels) == len(ids)
    assert all(l in (t, IGNORE_INDEX) for t, l in zip(ids, labels))
    assert tokenizer.decode(_targets(labels)) == "    return x * 0 + 1<eos>\n    return x * 1 + 1  # hello<eos>\n"
    kept = [i for i, l in enumerate(labels) if l != IGNORE_INDEX]
    assert tokenizer.decode(ids[:kept[0]]).endswith("<|assistant|>")  # the generation prompt is not a target


def test_prompt_completion_counts_the_completion_and_eos(tiny):
    tokenizer = set_chat_template(tiny, None)
    record = {"prompt": "def f3(x):", "completion": " return x * 3 + 1"}
    ids, labels = encode_record(tokenizer, record, "x line 1")
    assert ids == tokenizer(record["prompt"] + record["completion"], add_special_tokens=False)["input_ids"] + [0]
    n_prompt = len(tokenizer(record["prompt"], add_special_tokens=False)["input_ids"])
    assert labels == [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    assert tokenizer.decode(_targets(labels)) == " return x * 3 + 1<eos>"


def test_records_are_packed_and_the_sampler_cuts_labels_with_tokens(tiny, tmp_path):
    """A JSONL of the three kinds: the stream is the records' ids one after the other (labels too),
    split by range; every (x, y) of the sampler and the validation batches is (ids[i:i+T],
    labels[i+1:i+T+1]) for some i."""
    tokenizer = set_chat_template(tiny)
    records = [{"messages": CONVERSATION}, {"prompt": "def f2(x):", "completion": " return 2"},
               {"text": "def f5(x):\n    return x"}] * 6
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = tokenized_corpus([str(data)], tokenizer, max_bytes=1 << 20, val_fraction=0.2, vocab_size=VOCAB)
    encoded = [encode_record(tokenizer, r, "") for r in records]
    assert torch.cat([corpus.train, corpus.val]).tolist() == [t for ids, _ in encoded for t in ids]
    assert torch.cat([corpus.train_labels, corpus.val_labels]).tolist() == [t for _, ls in encoded for t in ls]
    assert len(corpus.train_labels) == len(corpus.train)
    seq = 16
    sampler = BatchSampler(corpus.train, 4, seq, seed=3, labels=corpus.train_labels)
    batches = [sampler.next_batch() for _ in range(5)]
    batches += validation_batches(corpus.val, 2, seq, 2, labels=corpus.val_labels)
    for k, (x, y) in enumerate(batches):
        ids, labels = (corpus.train, corpus.train_labels) if k < 5 else (corpus.val, corpus.val_labels)
        for row_x, row_y in zip(x, y):
            starts = [i for i in range(len(ids) - seq) if torch.equal(ids[i:i + seq], row_x)]
            assert any(torch.equal(labels[i + 1:i + seq + 1], row_y) for i in starts)
    assert any((y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any() for _, y in batches)


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}', r"bad.jsonl line 2: not JSON"),
    ('[1, 2]', r"bad.jsonl line 2: expected a JSON object"),
    ('{"prompt": "only a prompt"}', r'bad.jsonl line 2: expected a "completion" string'),
    ('{"question": "q", "answer": "a"}', r'bad.jsonl line 2: expected an object with a "text" string, "messages"'),
    ('{"messages": [{"role": "robot", "content": "beep"}]}', r"bad.jsonl line 2: message 0 has role 'robot'"),
    ('{"messages": [{"role": "user"}]}', r'bad.jsonl line 2: message 0 must be an object with a "content"'),
    ('{"messages": []}', r'bad.jsonl line 2: "messages" must be a non-empty list'),
])
def test_a_bad_line_is_named(tiny, tmp_path, line, message):
    tokenizer = set_chat_template(tiny)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        tokenized_corpus([str(bad)], tokenizer, max_bytes=1 << 16, val_fraction=0.1, vocab_size=VOCAB)
    assert "\n" not in str(e.value)


def test_messages_without_a_chat_template_and_a_template_that_is_not_prefix_stable(tiny, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tokenizer = set_chat_template(tiny, None)
    with pytest.raises(ValueError, match=r"chat.jsonl line 1: messages need a chat template"):
        tokenized_corpus([str(data)], tokenizer, max_bytes=1 << 16, val_fraction=0.1, vocab_size=VOCAB)
    # the number of turns written first: an earlier prefix is not a prefix of the whole
    tokenizer = set_chat_template(tiny, "{{ messages | length }}" + CHAT_TEMPLATE)
    with pytest.raises(ValueError, match=r"chat.jsonl line 1: the chat template does not render .* prefix by prefix"):
        tokenized_corpus([str(data)], tokenizer, max_bytes=1 << 16, val_fraction=0.1, vocab_size=VOCAB)


def test_empty_file_and_no_target(tiny, tmp_path):
    tokenizer = set_chat_template(tiny)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no records"):
        tokenized_corpus([str(empty)], tokenizer, max_bytes=1 << 16, val_fraction=0.1, vocab_size=VOCAB)
    users = tmp_path / "users.jsonl"
    users.write_text(json.dumps({"messages": [{"role": "user", "content": "def f(x): " * 20}]}) + "\n")
    with pytest.raises(ValueError, match=r"has no target token"):
        tokenized_corpus([str(users)], tokenizer, max_bytes=1 << 16, val_fraction=0.1, vocab_size=VOCAB)


def test_cli_prints_one_line_naming_the_line(tmp_path, capsys):
    directory = save_tiny(tmp_path, "llama")
    set_chat_template(directory)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATION}) + "\n"
                   + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    err = cli_error(capsys, ["train", "--model", f"hf:{directory}", "--data", str(bad), "--steps", "1", "--quiet"])
    assert "bad.jsonl line 2: message 0 has role 'bot'" in err


def test_a_datasets_directory_without_datasets_installed_is_one_line(tmp_path, capsys, monkeypatch):
    from pystronghold.extras import EXTRAS

    monkeypatch.setitem(EXTRAS, "data", ("pystronghold_no_such_module",))
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text("{}")
    err = cli_error(capsys, ["train", "--data", str(saved), "--steps", "1", "--quiet"])
    assert f"--data {saved} (a datasets save_to_disk directory) needs pystronghold_no_such_module" in err
    assert "pip install 'pystronghold[data]'" in err
