"""Bad Hugging Face directories, data and exports: one-line errors naming the file, tensor or
architecture, raised before anything is trained."""

from __future__ import annotations

import json
import re

import pytest
import torch

import pystronghold as ph
from pystronghold.cli import main
from pystronghold.tokenized import tokenized_corpus
from hf_models import save_tiny
from train_helpers import cli_error


def _shard_of(directory, name: str):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return directory / index["weight_map"][name]


def _rewrite(path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("change, message", [
    (dict(model_type="vit", architectures=["ViTModel"]), "builds no causal LM for model_type 'vit'"),
    (dict(model_type="t5", architectures=["T5ForConditionalGeneration"]), "T5ForConditionalGeneration is an "
                                                                           "encoder-decoder model"),
    (dict(model_type="not_a_family"), "model_type 'not_a_family' is unknown to transformers"),
    (dict(auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}), "is remote code (auto_map)"),
    (dict(is_encoder_decoder=True), "is an encoder-decoder model"),
])
def test_a_model_that_cannot_be_streamed_is_refused_in_one_line(tmp_path, capsys, change, message):
    directory = save_tiny(tmp_path, "gpt2", tokenizer=False)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, **change)))
    with pytest.raises(ValueError, match=re.escape(message)):
        ph.from_pretrained(directory, window=2)
    err = cli_error(capsys, ["train", "--model", f"hf:{directory}", "--data", str(directory / "config.json"),
                             "--steps", "1"])
    assert message in err and "config.json" in err


def test_a_model_without_one_stack_of_blocks_is_refused(tmp_path):
    from pystronghold.models.hf import block_stack

    class TwoStacks(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.config = config
            self.encoder = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
            self.decoder = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))

    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"one nn.ModuleList of num_hidden_layers=3 blocks to stream, found "
                                         r"encoder, decoder"):
        block_stack(TwoStacks(LlamaConfig(num_hidden_layers=3)))
    with pytest.raises(ValueError, match=r"found none"):
        block_stack(TwoStacks(LlamaConfig(num_hidden_layers=4)))


def test_missing_shard_is_named(tmp_path, capsys):
    directory = save_tiny(tmp_path, "llama")
    shard = _shard_of(directory, "model.layers.1.mlp.up_proj.weight")
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard.name}: shard missing"):
        ph.from_pretrained(directory, window=2)
    assert shard.name in cli_error(capsys, ["train", "--model", f"hf:{directory}", "--data", str(directory / "config.json"),
                                            "--steps", "1", "--quiet"])


def test_non_float_tensor_is_named_with_its_file_and_dtype(tmp_path):
    directory = save_tiny(tmp_path, "llama", tokenizer=False)
    name = "model.layers.2.self_attn.k_proj.weight"
    shard = _shard_of(directory, name)
    _rewrite(shard, lambda t: t.update({name: t[name].to(torch.int32)}))
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor '{name}' has dtype I32"):
        ph.from_pretrained(directory, window=2)


def test_tensor_shape_that_config_does_not_make_is_named(tmp_path):
    directory = save_tiny(tmp_path, "gpt2", tokenizer=False)
    name = "transformer.h.1.mlp.c_fc.weight"
    shard = _shard_of(directory, name)
    _rewrite(shard, lambda t: t.update({name: t[name][:, :64].contiguous()}))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[32, 64\], config.json makes it \[32, 128\]"):
        ph.from_pretrained(directory, window=2)


def test_tensor_missing_from_the_shards_is_named(tmp_path):
    directory = save_tiny(tmp_path, "qwen2", tokenizer=False)
    name = "model.layers.0.self_attn.q_proj.bias"
    shard = _shard_of(directory, name)
    _rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"{shard.name}: has no tensor '{name}'"):
        ph.from_pretrained(directory, window=2)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"no tensor '{name}' in the safetensors files"):
        ph.from_pretrained(directory, window=2)


def test_missing_tokenizer_is_one_line(tmp_path, capsys):
    directory = save_tiny(tmp_path, "gpt2", tokenizer=False)
    err = cli_error(capsys, ["train", "--model", f"hf:{directory}", "--data", str(directory / "config.json"),
                             "--steps", "1", "--quiet"])
    assert "no tokenizer in the model directory" in err


def test_bad_jsonl_line_and_foreign_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    directory = save_tiny(tmp_path, "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text key"}\n')
    with pytest.raises(ValueError, match=r'bad.jsonl line 2: expected an object with a "text" string'):
        tokenized_corpus([str(bad)], tokenizer, max_bytes=4096, val_fraction=0.1, vocab_size=300)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"def f{k}(x): return x"}) + "\n" for k in range(20)))
    corpus = tokenized_corpus([str(good)], tokenizer, max_bytes=4096, val_fraction=0.1, vocab_size=300)
    assert corpus.train.dtype == torch.int64 and int((corpus.train == tokenizer.eos_token_id).sum()) >= 17
    with pytest.raises(ValueError, match=r"the model's vocabulary has 100 entries"):
        tokenized_corpus([str(good)], tokenizer, max_bytes=4096, val_fraction=0.1, vocab_size=100)


def test_export_hf_refuses_a_gpt_checkpoint_and_a_full_directory(tmp_path, capsys):
    from pystronghold.train import Trainer, resolve
    from pystronghold.train.checkpoint_dir import latest_checkpoint
    from train_helpers import tiny_config

    ck = tmp_path / "ck"
    trainer = Trainer(resolve(tiny_config(tmp_path, steps=1, ckpt=str(ck))))
    try:
        trainer.train()
    finally:
        trainer.close()
    err = cli_error(capsys, ["export", str(ck), str(tmp_path / "out"), "--hf"])
    assert "holds pystronghold's own GPT" in err and str(latest_checkpoint(ck)) in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not an empty directory" in cli_error(
        capsys, ["export", str(ck), str(tmp_path / "full"), "--hf"])


def test_tensor_parallel_of_a_model_with_attention_dropout_is_one_line_naming_the_field(tmp_path, capsys):
    """GPT-2's published configs drop attention probabilities (attn_pdrop 0.1): split heads cannot draw
    one process's masks, so --tp says which config.json field to set before any process starts."""
    directory = save_tiny(tmp_path, "gpt2", tokenizer=False)
    err = cli_error(capsys, ["train", "--model", f"hf:{directory}", "--tp", "2"])
    assert f"--tp 2: --model hf:{directory.resolve()} (gpt2): attn_pdrop=0.1 drops attention " in err
    assert err.count("\n") <= 1 and "set it to 0 in config.json or train with --tp 1" in err
    assert "no such directory" in cli_error(capsys, ["train", "--model", f"hf:{tmp_path / 'nope'}"])


def test_an_hf_model_without_data_is_refused_and_the_demo_keeps_its_default(tmp_path, capsys):
    """A forgotten --data must not fine-tune on the embedded default corpus (the standard library)
    without a word; the demo, our own byte-level model, still trains on it."""
    from pystronghold.cli import build_parser
    from pystronghold.train.command import config_from_args

    directory = save_tiny(tmp_path, "gpt2")
    err = cli_error(capsys, ["train", "--model", f"hf:{directory}", "--steps", "1", "--quiet"])
    assert err.strip() == "pystronghold train: error: --model hf:DIR needs --data (the text, .jsonl records or " \
                          "token file to fine-tune on)"
    assert config_from_args(build_parser().parse_args(["train", "--steps", "1"])).data.data == []


def test_export_hf_names_a_moved_tokenizer_source_and_writes_files_by_the_umask(tmp_path, capsys):
    """The run's --model hf:DIR moved away: one line naming it and the options, nothing written;
    --tokenizer DIR copies from there, --no-tokenizer writes none. Files get the umask's mode
    (safetensors alone leaves its files 0600)."""
    import os
    import stat

    directory = save_tiny(tmp_path, "gpt2")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    ck = tmp_path / "ck"
    assert main(["train", "--model", f"hf:{directory}", "--data", str(text), "--steps", "1", "--batch", "2",
                 "--seq", "16", "--eval-every", "0", "--eval-batches", "1", "--quiet", "--checkpoint-dir",
                 str(ck)]) == 0
    moved = directory.rename(tmp_path / "moved")
    err = cli_error(capsys, ["export", str(ck), str(tmp_path / "out"), "--hf"])
    assert f"the tokenizer source {directory} (the run's --model hf:DIR) does not exist" in err
    assert "give --tokenizer DIR" in err and "--no-tokenizer" in err
    assert not (tmp_path / "out").exists()
    assert "--tokenizer, --no-tokenizer and --merge need --hf" in cli_error(
        capsys, ["export", str(ck), str(tmp_path / "w.safetensors"), "--tokenizer", str(moved)])

    def modes(path):
        return {p.name: stat.S_IMODE(p.stat().st_mode) for p in ([path] if path.is_file() else path.iterdir())}

    umask = os.umask(0o022)
    try:
        assert main(["export", str(ck), str(tmp_path / "out"), "--hf", "--tokenizer", str(moved)]) == 0
        assert main(["export", str(ck), str(tmp_path / "bare"), "--hf", "--no-tokenizer"]) == 0
        os.umask(0o027)
        assert main(["export", str(ck), str(tmp_path / "w.safetensors")]) == 0
    finally:
        os.umask(umask)
    written = modes(tmp_path / "out")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(written)
    assert set(written.values()) == {0o644}, written
    assert not any(name.startswith("tokenizer") for name in modes(tmp_path / "bare"))
    assert modes(tmp_path / "w.safetensors") == {"w.safetensors": 0o640}
