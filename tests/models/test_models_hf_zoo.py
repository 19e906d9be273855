"""Every causal-LM family of ``hf_models.FAMILIES`` (dense and MoE), saved by transformers itself,
loads, trains and saves back through pystronghold.

Per family, one test shares the work: (a) ``from_pretrained`` gives transformers' own
``from_pretrained`` logits exactly (fp32, ``rtol=0, atol=0``: the same modules on the same
weights); (b) 3 steps through the window give the losses and weights of the same model trained by
plain PyTorch (``torch.optim.AdamW``; the engine's Adam with ``bitwise_torch``), compared with
``rtol=0``: on CPU in fp32 they are bit for bit; (c) ``save_pretrained`` writes the family's own
checkpoint layout (the tensor names transformers saved, a Mixtral's experts one by one), which
transformers reloads with the trained weights exactly, and ``generate`` runs on it. The CLI
(``train --model hf:DIR``, ``export --hf``) is run for three families, one a mixture of experts.
"""

from __future__ import annotations

import json

import pytest
import torch

import pystronghold as ph
from pystronghold.cli import main
from hf_models import FAMILIES, MOE_FAMILIES, TEXT, VOCAB, engine_logits, hf_logits, save_tiny
from runtime_models import HYPER, one_torch_thread, train_reference

transformers = pytest.importorskip("transformers")

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 3


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(n)]


def _lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


def _stored_names(directory) -> set[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _hf_load(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_trains_and_saves_like_transformers(tmp_path, family):
    directory = save_tiny(tmp_path, family, tokenizer=False)
    x, data = _batches(1, seed=3)[0], _batches(STEPS)
    reference = _hf_load(directory)
    reference.eval()
    with torch.no_grad():
        expected_logits = reference(input_ids=x).logits
    reference.train()
    torch.manual_seed(1234)  # dropout (GPT-2's, Falcon's...): the same masks for both runs
    ref_losses, ref_params = train_reference(reference, data, loss_of=_lm_loss)

    engine = ph.from_pretrained(directory, window=2, optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    try:
        assert engine.n_blocks == 3
        torch.testing.assert_close(engine_logits(engine, x), expected_logits, rtol=0, atol=0)  # (a)
        torch.manual_seed(1234)
        losses = []
        for batch in data:
            loss = _lm_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            losses.append(loss.item())
        trained_logits = engine_logits(engine, x)
        ph.save_pretrained(engine, tmp_path / "saved", max_shard_bytes=20_000)
    finally:
        engine.close()
    assert losses == ref_losses, (losses, ref_losses)  # (b) bit for bit

    saved = tmp_path / "saved"
    assert _stored_names(saved) == _stored_names(directory)  # (c) the family's own layout
    assert (saved / "generation_config.json").is_file()
    reloaded = _hf_load(saved)
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=0, atol=0, msg=name)
    reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, trained_logits, rtol=0, atol=0)
        out = reloaded.generate(x[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("family", ["phi3", "gpt_neox", "mixtral"])
def test_cli_train_then_export_hf_reloads_in_transformers(tmp_path, family):
    """`train --model hf:DIR` then `export CKPT OUT --hf`: transformers loads OUT in the family's
    layout, with weights that differ from the base (the run trained them) and the tokenizer beside."""
    assert "mixtral" in MOE_FAMILIES
    directory = save_tiny(tmp_path, family)
    text = tmp_path / "text.txt"
    text.write_text("".join(TEXT * 4))
    ck, out = tmp_path / "ck", tmp_path / "out"
    assert main(["train", "--model", f"hf:{directory}", "--data", str(text), "--steps", "2", "--batch", "2",
                 "--seq", "16", "--max-bytes", "16384", "--eval-every", "0", "--eval-batches", "1", "--quiet",
                 "--checkpoint-dir", str(ck)]) == 0
    assert main(["export", str(ck), str(out), "--hf", "--max-shard-size", "30kB"]) == 0
    assert _stored_names(out) == _stored_names(directory)
    assert (out / "tokenizer.json").is_file()
    base, tuned = _hf_load(directory), _hf_load(out)
    changed = [name for name, p in tuned.named_parameters()
               if not torch.equal(p, base.get_parameter(name))]
    assert changed and len(changed) > len(list(tuned.parameters())) // 2
    with torch.no_grad():
        assert tuned.generate(_batches(1)[0][:1, :4], max_new_tokens=3, do_sample=False,
                              pad_token_id=0).shape == (1, 7)


def test_an_moe_checkpoint_is_read_per_expert_block_by_block(tmp_path):
    """A Mixtral stored per expert is read per block: materializing block i reads only block i's
    stored tensors (its experts fused by transformers' converter), and nothing stays mapped."""
    from pystronghold.models.hf import load_lazy

    directory = save_tiny(tmp_path, "mixtral", tokenizer=False)
    assert any(".experts.0.w1." in name for name in _stored_names(directory))
    lazy = load_lazy(directory)
    reads = []
    read = lazy.shards.read
    lazy.shards.read = lambda key, *a, **k: reads.append(key) or read(key, *a, **k)
    try:
        lazy.materialize(1)
    finally:
        lazy.shards.read = read
    assert reads and all(name.startswith("model.layers.1.") for name in reads)
    assert sum(".experts." in name for name in reads) == 3 * 4  # w1, w2, w3 of 4 experts
    assert lazy.shards.open_files == []
    assert not any(p.is_meta for p in lazy.blocks[1].parameters())
    assert all(p.is_meta for p in lazy.blocks[2].parameters())


@pytest.mark.parametrize("family", ["gpt2", "mixtral"])
def test_bf16_single_file_checkpoints_load_as_transformers_loads_them(tmp_path, family):
    """A checkpoint saved in bf16 as one model.safetensors (GPT-2: tied, without the base model's
    prefix, as the original checkpoints): the fp32 logits of transformers' own load of it."""
    from safetensors.torch import load_file, save_file

    directory = save_tiny(tmp_path, family, tokenizer=False)
    model = _hf_load(directory).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "bf16"), max_shard_size="1GB")
    single = tmp_path / "bf16" / "model.safetensors"
    if family == "gpt2":
        tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(single)).items()}
        save_file(tensors, str(single), metadata={"format": "pt"})
    assert not (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    x = _batches(1)[0]
    engine = ph.from_pretrained(tmp_path / "bf16", window=1)
    try:
        torch.testing.assert_close(engine_logits(engine, x), hf_logits(tmp_path / "bf16", x), rtol=0, atol=0)
    finally:
        engine.close()


def test_a_conversion_that_mixes_blocks_is_refused(tmp_path, monkeypatch):
    """A converter that makes tensors of two blocks from one stored tensor cannot be read one block
    at a time: one line naming the stored tensor."""
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    directory = save_tiny(tmp_path, "llama", tokenizer=False)
    across = WeightConverter(source_patterns="layers.0.self_attn.q_proj.weight",
                             target_patterns=["layers.0.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight"],
                             operations=[Chunk(dim=0)])
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model, **kw: [across])
    with pytest.raises(ValueError, match=r"conversion of 'model.layers.0.self_attn.q_proj.weight' makes tensors "
                                         r"of several blocks \(0, 1\); it cannot be loaded one block at a time"):
        ph.from_pretrained(directory, window=2)


def test_save_pretrained_copies_the_tokenizer_of_the_directory_loaded_from(tmp_path):
    directory = save_tiny(tmp_path, "qwen3_moe")
    engine = ph.from_pretrained(directory, window=1)
    try:
        ph.save_pretrained(engine, tmp_path / "saved")
    finally:
        engine.close()
    assert (tmp_path / "saved" / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
