"""``train --loss-chunk``: a run whose loss goes chunk by chunk trains to the losses of the run that
makes the full logits (fp32 within 1e-6 relative per step; bf16 within 2e-2), for our GPT with
accumulation and clipping, and for Hugging Face models (a plain one, a soft-capped one, a mixture of
experts and a LoRA fine-tune)."""

from __future__ import annotations

import dataclasses

import pytest

from pystronghold.options import ConfigError
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.settings.finetune import FinetuneOptions
from pystronghold.train.config import DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import save_tiny
from train_helpers import run_training, text_dir, tiny_config


def _losses(config, chunk):
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, loss_chunk=chunk))
    return [loss for _, loss in run_training(config).losses]


def _close(got, want, rtol):
    assert len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-6), ("bf16", 2e-2)])
def test_gpt_losses_with_a_chunked_loss_are_the_full_logits_losses(tmp_path, precision, rtol):
    config = tiny_config(tmp_path, steps=4, precision=precision, accumulation=2, clip=0.5)  # 128 tokens
    _close(_losses(config, 40), _losses(config, 0), rtol)


@pytest.mark.parametrize("family,lora", [("llama", None), ("gemma2", None), ("qwen2_moe", None), ("llama", 4)])
def test_hf_losses_with_a_chunked_loss_are_the_full_logits_losses(tmp_path, family, lora):
    directory = save_tiny(tmp_path, family)
    config = TrainConfig(
        model=ModelOptions(model=f"hf:{directory}"),
        finetune=FinetuneOptions(lora_rank=lora),
        data=DataOptions(data=[str(text_dir(tmp_path))], max_bytes=1 << 14, batch=2, seq=24),
        optim=OptimOptions(lr=3e-3, warmup=1),
        runtime=RuntimeConfig(window=2, clip_grad_norm=1.0, accumulation_steps=2),
        run=RunOptions(steps=3, log_every=3, eval_every=0, eval_batches=1, quiet=True))
    _close(_losses(config, 7), _losses(config, 0), 1e-6)


def test_a_bad_loss_chunk_is_one_line():
    with pytest.raises(ConfigError, match="loss_chunk=-3 must be a number of tokens >= 0 or 'auto'"):
        DataOptions(loss_chunk=-3)
    with pytest.raises(ConfigError) as bad:
        DataOptions(loss_chunk="some")
    assert bad.value.on_command_line() == "--loss-chunk some must be a number of tokens >= 0 or 'auto'"
