"""``train --mlp-tile``: a run whose MLPs go tile by tile trains to the losses of the untiled run
(fp32 within 1e-6 relative per step, the first bit for bit; bf16 within 2e-2) for our GPT with
accumulation and clipping and for Hugging Face models (Llama, Qwen2, Gemma 2, a LoRA fine-tune);
auto tiles by ``nn.tiled.mlp_tile_tokens``; a bad value is one line."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from pystronghold.cli import build_parser
from pystronghold.nn.tiled import mlp_tile_tokens
from pystronghold.options import ConfigError
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.settings.finetune import FinetuneOptions
from pystronghold.train import resolve
from pystronghold.train.checkpoint import read_manifest
from pystronghold.train.command import config_from_args
from pystronghold.train.config import DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import save_tiny
from train_helpers import run_training, text_dir, tiny_config


def _losses(config, tile):
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, mlp_tile=tile))
    return [loss for _, loss in run_training(config).losses]


def _close(got, want, rtol):
    assert len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-6), ("bf16", 2e-2)])
def test_gpt_losses_with_a_tiled_mlp_are_the_untiled_losses(tmp_path, precision, rtol, caplog):
    config = tiny_config(tmp_path, steps=4, precision=precision, accumulation=2, clip=0.5)  # T = 32
    with caplog.at_level(logging.INFO, logger="pystronghold.train"):
        got = _losses(config, 12)  # tiles of 12, 12 and 8 positions
    assert "every block runs over tiles of 12 positions" in caplog.text
    want = _losses(config, "off")
    assert got[0] == want[0] or precision != "fp32"
    _close(got, want, rtol)


@pytest.mark.parametrize("family,lora", [("llama", None), ("qwen2", None), ("gemma2", None), ("llama", 4)])
def test_hf_losses_with_a_tiled_mlp_are_the_untiled_losses(tmp_path, family, lora, caplog):
    directory = save_tiny(tmp_path, family)
    config = TrainConfig(
        model=ModelOptions(model=f"hf:{directory}"),
        finetune=FinetuneOptions(lora_rank=lora),
        data=DataOptions(data=[str(text_dir(tmp_path))], max_bytes=1 << 14, batch=2, seq=24),
        optim=OptimOptions(lr=3e-3, warmup=1),
        runtime=RuntimeConfig(window=2, clip_grad_norm=1.0, accumulation_steps=2),
        run=RunOptions(steps=3, log_every=3, eval_every=0, eval_batches=1, quiet=True))
    with caplog.at_level(logging.INFO, logger="pystronghold.train"):
        got = _losses(config, 7)
    assert "3 of 3 blocks run over tiles of 7 positions" in caplog.text
    _close(got, _losses(config, 0), 1e-6)


def test_auto_tiles_when_the_intermediate_passes_its_budget(tmp_path):
    model = tmp_path / "wide.json"
    model.write_text(json.dumps({"vocab_size": 256, "seq_len": 65536, "layers": 2, "hidden": 1024, "heads": 8}))
    config = TrainConfig(model=ModelOptions(model=str(model)), data=DataOptions(batch=2, seq=65536))
    assert config.data.mlp_tile == "auto"
    assert resolve(config).mlp_tile_tokens == mlp_tile_tokens(2, 65536, 4096, 4) == 8192  # 2 x 64K x 4096 x 4 B = 2 GiB
    short = dataclasses.replace(config, data=dataclasses.replace(config.data, seq=4096))
    assert resolve(short).mlp_tile_tokens == 0  # 128 MiB: untiled


def test_the_command_line_takes_tokens_auto_and_off():
    def tile(*argv):
        return config_from_args(build_parser().parse_args(["train", *argv])).data.mlp_tile

    assert (tile(), tile("--mlp-tile", "512"), tile("--mlp-tile", "off"), tile("--mlp-tile", "auto")) == \
        ("auto", 512, 0, "auto")
    with pytest.raises(ConfigError) as bad:
        DataOptions(mlp_tile="some")
    assert bad.value.on_command_line() == "--mlp-tile some must be a number of tokens >= 0, 'auto' or 'off'"
    with pytest.raises(ConfigError, match="mlp_tile=-3 must be a number of tokens"):
        DataOptions(mlp_tile=-3)


def test_the_tile_is_no_part_of_a_checkpoints_model(tmp_path):
    """Checkpoints keep the model record they had before tiling existed (so old ones resume), and a
    run resumes with another --mlp-tile; a model file cannot set it."""
    config = tiny_config(tmp_path, steps=2, ckpt=str(tmp_path / "ck"))
    run_training(dataclasses.replace(config, data=dataclasses.replace(config.data, mlp_tile=8)))
    (saved,) = (tmp_path / "ck").glob("step-*")
    assert "mlp_tile_tokens" not in read_manifest(saved)["model"]
    more = tiny_config(tmp_path, steps=3, ckpt=str(tmp_path / "ck"), resume=True)
    result = run_training(dataclasses.replace(more, data=dataclasses.replace(more.data, mlp_tile=0)))
    assert result.start_step == 2 and len(result.losses) == 1
    model = tmp_path / "tiled.json"
    model.write_text(json.dumps({"vocab_size": 256, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 2,
                                 "mlp_tile_tokens": 8}))
    with pytest.raises(ValueError, match="mlp_tile_tokens is a setting of the run, not of the model: give --mlp-tile"):
        resolve(TrainConfig(model=ModelOptions(model=str(model))))
