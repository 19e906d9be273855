"""Fine-tuning a Hugging Face model from a local directory and exporting it back.

Every model is a tiny random config written to the test's tmp directory (``hf_models``); nothing is
downloaded. Logits are compared in fp32 with ``rtol=0, atol=0``: the engine runs the same modules on
the same fp32 weights as transformers, and the export writes the fp32 masters, so they are equal.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import pystronghold as ph
from pystronghold.cli import main
from pystronghold.train import Trainer, resolve
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.train.config import CheckpointOptions, DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import ARCHS, TEXT, VOCAB, engine_logits, hf_logits, save_tiny
from train_helpers import run_training

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=g) for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_model_gives_transformers_own_logits(tmp_path, arch):
    """Blocks built one at a time from the shards into the store: the same logits as
    transformers' from_pretrained of the same directory."""
    directory = save_tiny(tmp_path, arch)
    assert len(list(directory.glob("model-*.safetensors"))) > 2  # really sharded
    x = batches(1)[0]
    engine = ph.from_pretrained(directory, window=2)
    try:
        assert engine.n_blocks == 3
        torch.testing.assert_close(engine_logits(engine, x), hf_logits(directory, x), rtol=0, atol=0)
    finally:
        engine.close()


def test_blocks_are_read_from_the_shards_one_at_a_time(tmp_path):
    """Head and tail are loaded, the blocks stay on meta, and when wrap() materializes block i no
    other block holds real weights outside the store (earlier ones are placeholders, later ones meta),
    and no shard stays memory-mapped between blocks (its pages would stay resident)."""
    from pystronghold.models.hf import load_lazy

    lazy = load_lazy(save_tiny(tmp_path, "llama", tokenizer=False))
    assert all(p.is_meta for p in lazy.blocks.parameters())
    assert lazy.shards.open_files == []
    assert not any(p.is_meta for n, p in lazy.model.named_parameters() if not n.startswith("model.layers."))
    real_blocks_at_call = []

    def materialize(i):
        real_blocks_at_call.append([j for j, b in enumerate(lazy.blocks)
                                    if any(p.numel() and not p.is_meta for p in b.parameters())])
        block = lazy.materialize(i)
        assert lazy.shards.open_files == []
        return block

    ph.wrap(lazy.model, blocks=lazy.blocks, materialize=materialize, window=2).close()
    assert real_blocks_at_call == [[], [], []]


def test_single_file_weights_through_the_nvme_tier(tmp_path):
    """One model.safetensors (no index), every block state on disk: the same logits."""
    directory = save_tiny(tmp_path, "llama", shard_size="1GB")
    assert (directory / "model.safetensors").is_file()
    assert not (directory / "model.safetensors.index.json").exists()
    x = batches(1)[0]
    engine = ph.from_pretrained(directory, window=1, nvme_dir=str(tmp_path / "nvme"), nvme_states="all")
    try:
        torch.testing.assert_close(engine_logits(engine, x), hf_logits(directory, x), rtol=0, atol=0)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_python_fine_tune_matches_plain_pytorch_and_saves_back(tmp_path, arch):
    """5 steps through the window give plain transformers + torch.optim.AdamW's losses (GPT-2 with
    its default dropout 0.1: the engine replays the RNG in the recompute); save_pretrained writes a
    directory transformers loads with the trained engine's logits."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path, arch)
    data = batches(5)
    torch.manual_seed(7)
    engine = ph.from_pretrained(directory, window=2, optimizer=ph.AdamW(**HYPER))
    got = []
    try:
        for x in data:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            got.append(loss.item())
        x = batches(1, seed=3)[0]
        trained = engine_logits(engine, x)
        ph.save_pretrained(engine, tmp_path / "tuned", max_shard_bytes=30_000, tokenizer_dir=directory)
    finally:
        engine.close()
    assert (tmp_path / "tuned" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "tuned" / "tokenizer.json").is_file()
    torch.testing.assert_close(hf_logits(tmp_path / "tuned", x), trained, rtol=0, atol=0)
    ref = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    torch.manual_seed(7)
    expected = []
    for x in data:
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-6, atol=0)


def _train_config(directory, data, ckpt, *, steps=5, every=0, resume=False) -> TrainConfig:
    return TrainConfig(
        model=ModelOptions(model=f"hf:{directory}"),
        data=DataOptions(data=[str(data)], max_bytes=1 << 14, batch=2, seq=16),
        optim=OptimOptions(lr=3e-3, warmup=2),
        runtime=RuntimeConfig(window=2, clip_grad_norm=1.0),
        run=RunOptions(steps=steps, log_every=5, eval_every=0, eval_batches=1, quiet=True),
        checkpoint=CheckpointOptions(checkpoint_dir=str(ckpt), checkpoint_every=every, resume=resume))


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_cli_train_export_hf_reload_gives_the_engine_logits(tmp_path, arch):
    """`train --model hf:DIR` on JSONL, `export --hf`, reload with AutoModelForCausalLM: the logits of
    the trained engine (restored from the same checkpoint by --resume)."""
    directory = save_tiny(tmp_path, arch)
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT * 4))
    ck, out = tmp_path / "ck", tmp_path / "tuned"
    assert main(["train", "--model", f"hf:{directory}", "--data", str(jsonl), "--steps", "5", "--batch", "2",
                 "--seq", "16", "--max-bytes", "16384", "--eval-every", "0", "--eval-batches", "1", "--quiet",
                 "--checkpoint-dir", str(ck)]) == 0
    assert main(["export", str(ck), str(out), "--hf", "--max-shard-size", "30kB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["architectures"] == [f"{_ARCH_NAMES[arch]}"]
    assert (out / "tokenizer.json").is_file()
    trainer = Trainer(resolve(_train_config(directory, jsonl, ck, resume=True)))
    x = batches(1, seed=3)[0]
    try:
        assert trainer.step == 5
        trained = engine_logits(trainer.engine, x)
    finally:
        trainer.close()
    torch.testing.assert_close(hf_logits(out, x), trained, rtol=0, atol=0)
    assert not torch.equal(trained, hf_logits(directory, x))  # training changed the weights


def test_resumed_hf_run_gives_the_uninterrupted_losses(tmp_path):
    """A run killed after its step-3 checkpoint and resumed: steps 4 and 5 give the losses of the
    uninterrupted run (fp32, bit for bit; token data position and model restored)."""
    directory = save_tiny(tmp_path, "llama")
    text = tmp_path / "text.txt"
    text.write_text("".join(TEXT * 6))

    def run(ck, every=0, resume=False):
        config = _train_config(directory, text, ck, every=every, resume=resume)
        return [loss for _, loss in run_training(config).losses]

    whole = run(tmp_path / "a")
    run(tmp_path / "b", every=3)
    shutil.rmtree(tmp_path / "b" / "step-00000005")  # as if the run had been killed after step 3
    assert run(tmp_path / "b", resume=True) == whole[3:]


_ARCH_NAMES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}
