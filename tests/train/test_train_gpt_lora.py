"""`pystronghold train --model tiny --lora-rank R`: LoRA adapters (PEFT) on pystronghold's GPT built
one block at a time. Its losses are plain PyTorch + peft + torch.optim.AdamW's bit for bit, a resumed
run gives the uninterrupted losses (the checkpoint keeps the frozen base: a GPT has no base directory),
`export` writes the merged GPT, `plan` counts the trainable parameters the engine trains, and `train`
and `plan` refuse bad fine-tune options with the same one line."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from pystronghold.cli import build_parser, main
from pystronghold.data import BatchSampler, DataConfig, load_corpus
from pystronghold.lr_schedule import warmup_cosine
from pystronghold.models import GPT, PRESETS
from pystronghold.models.lora import add_lora
from pystronghold.settings.finetune import LoraSpec
from pystronghold.train import Trainer, resolve
from pystronghold.train.command import config_from_args
from train_helpers import cli_error, text_dir

LORA = ["--lora-rank", "4", "--lora-targets", "qkv,fc2"]
STEPS, BATCH, SEQ, MAX_BYTES, LR = 6, 2, 32, 16384, 1e-2


@pytest.fixture
def text(tmp_path):
    return text_dir(tmp_path)


@pytest.fixture
def bitwise_adamw(monkeypatch):
    """The trainer's AdamW with torch's CPU square root (``bitwise_torch``): exact against torch.optim.AdamW."""
    from pystronghold.train import loop

    monkeypatch.setattr(loop, "AdamW", functools.partial(loop.AdamW, bitwise_torch=True))


def train_args(text, ck, *, lora=LORA, steps=STEPS, every=0, resume=False, metrics=None) -> list[str]:
    return (["train", "--model", "tiny", *lora, "--data", str(text), "--steps", str(steps), "--batch", str(BATCH),
             "--seq", str(SEQ), "--max-bytes", str(MAX_BYTES), "--lr", str(LR), "--warmup", "2", "--window", "2",
             "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--quiet", "--checkpoint-dir", str(ck),
             "--checkpoint-every", str(every)]
            + (["--resume"] if resume else []) + (["--metrics-file", str(metrics)] if metrics else []))


def losses(metrics) -> list[float]:
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def reference_losses(text) -> list[float]:
    """The run of ``train_args`` in plain PyTorch: the tiny GPT (seed 0) with PEFT's adapters on qkv
    and fc2, every block materialized as the trainer does, trained by torch.optim.AdamW over the
    adapters (betas (0.9, 0.99), weight decay 0.01 on these matrices) with clipping at 1.0 and the
    warm-up + cosine schedule, on the trainer's batches."""
    gpt = GPT(PRESETS["tiny"], seed=0, materialize_blocks=False)
    model, _ = add_lora(gpt, LoraSpec(rank=4, alpha=8.0, targets=("qkv", "fc2")), seed=0)
    for i in range(len(gpt.blocks)):
        gpt.materialize_block_(i)
    base = dict(GPT(PRESETS["tiny"], seed=0).named_parameters())
    for name, p in model.named_parameters():  # the base is the plain GPT's, B starts at zero
        own = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(p, base[own]) if own in base else ("lora_B" in name) == (not p.any()), name
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    schedule = warmup_cosine(opt, warmup_steps=2, decay_steps=STEPS, min_ratio=0.1)
    corpus = load_corpus(DataConfig(paths=[str(text)], max_bytes=MAX_BYTES, val_fraction=0.05))
    sampler = BatchSampler(corpus.train, BATCH, SEQ, seed=0)
    out = []
    for _ in range(STEPS):
        x, y = sampler.next_batch()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_lora_on_the_gpt_trains_to_plain_peft_and_resumes_bit_for_bit(tmp_path, text, peft, bitwise_adamw):
    """6 steps through the CLI give plain PyTorch + peft's losses exactly (fp32); 3 + 3 steps (the
    second run resuming the step-3 checkpoint) give the same losses. The checkpoint holds the base
    as the GPT drew it, and the adapters with their moments."""
    assert main(train_args(text, tmp_path / "a", metrics=tmp_path / "a.jsonl")) == 0
    whole = losses(tmp_path / "a.jsonl")
    assert whole == reference_losses(text) and whole[0] != whole[-1]
    assert main(train_args(text, tmp_path / "b", every=3)) == 0
    shutil.rmtree(tmp_path / "b" / "step-00000006")  # as if killed after step 3
    assert main(train_args(text, tmp_path / "b", resume=True, metrics=tmp_path / "b.jsonl")) == 0
    assert losses(tmp_path / "b.jsonl") == whole[3:]

    from safetensors.torch import load_file

    ck = tmp_path / "a" / "step-00000006"
    block = load_file(str(ck / "blocks" / "block-00001.safetensors"))
    initial = dict(GPT(PRESETS["tiny"], seed=0).named_parameters())
    assert torch.equal(block["base_model.model.blocks.1.attn.qkv.base_layer.weight"], initial["blocks.1.attn.qkv.weight"])
    assert "base_model.model.blocks.1.mlp.fc2.lora_B.default.weight.exp_avg" in block
    assert not any(k.endswith(".base_layer.weight.exp_avg") for k in block)
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["finetune"]["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["fc2", "qkv"], "dropout": 0.0}
    assert "base" not in manifest


def test_export_writes_the_merged_gpt_and_export_hf_is_one_line(tmp_path, text, peft, capsys):
    """`export CKPT OUT.safetensors` of a GPT LoRA run: the GPT's own state dict with B A merged
    into each adapted weight, which a plain GPT loads to the trained engine's logits (up to the
    rounding of W + s B A against W x + s B (A x)). `export --hf`: one line (not a Hugging Face model)."""
    args = train_args(text, tmp_path / "ck", steps=3)
    assert main(args) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0
    from safetensors.torch import load_file

    merged = GPT(PRESETS["tiny"], seed=1)
    merged.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    trainer = Trainer(resolve(config_from_args(build_parser().parse_args(args + ["--resume"]))))
    try:
        trainer.engine.model.eval()
        with torch.no_grad():
            trained = trainer.engine(x)
    finally:
        trainer.close()
    with torch.no_grad():
        assert not torch.equal(trained, GPT(PRESETS["tiny"], seed=0)(x))  # the adapters changed the model
        torch.testing.assert_close(merged(x), trained, rtol=0, atol=1e-5)
    assert "holds pystronghold's own GPT" in cli_error(capsys, ["export", str(tmp_path / "ck"), str(tmp_path / "o"),
                                                                "--hf"])


@pytest.mark.parametrize("targets", [None, "qkv,fc2,lm_head,pos"])
def test_plan_counts_the_trainable_parameters_train_trains(tmp_path, text, peft, targets):
    """The planner's trainable parameters of the tiny preset fine-tuned with the train run's own
    options (LoRA with the default targets, and with adapters on the head's position embedding and
    the untied LM head too) are the engine's."""
    from pystronghold.planner import Hardware, Workload, gpu_preset, make_plan
    from pystronghold.planner.hardware import GiB

    lora = ["--lora-rank", "4"] + (["--lora-targets", targets] if targets else [])
    trainer = Trainer(resolve(config_from_args(build_parser().parse_args(train_args(text, tmp_path / "ck", lora=lora)))))
    try:
        trained = trainer.engine.stats()["trainable_params"]
    finally:
        trainer.close()
    # NOTE: make_plan at a given window: `plan`'s largest-model search is slow at this tiny width
    plan = make_plan(PRESETS["tiny"], Workload(batch=BATCH, seq=SEQ, finetune=trainer.config.finetune),
                     Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 * GiB), window=2, resident_blocks=0)
    assert plan.trainable_params == trained > 0


@pytest.mark.parametrize("options", [
    ["--lora-rank", "0"],
    ["--lora-targets", "qkv"],
    ["--lora-rank", "4", "--freeze", "attn"],
    ["--freeze", "("],
    ["--lora-rank", "4", "--lora-targets", "q_proj"],
    ["--lora-rank", "4", "--lora-targets", "tok"],
])
def test_train_and_plan_refuse_bad_fine_tune_options_with_the_same_line(tmp_path, text, peft, capsys, options):
    train = cli_error(capsys, ["train", "--model", "tiny", *options, "--data", str(text), "--steps", "1", "--quiet"])
    plan = cli_error(capsys, ["plan", "--gpu", "h100-80gb", "--host-memory", "64", "--model", "tiny", *options])
    assert train.partition(" error: ")[2] == plan.partition(" error: ")[2] != ""
