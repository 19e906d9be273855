"""Learning-rate defaults of `pystronghold train`: each preset's published peak lr, --lr defaulting
to the model's, an explicit --lr winning, JSON models with and without "lr"."""

from __future__ import annotations

import json

import pytest

from pystronghold.cli import build_parser
from pystronghold.models.presets import PRESET_LR, PRESETS, SMALL_MODEL_LR, param_count, recommended_lr
from pystronghold.train import Trainer, resolve
from pystronghold.train.command import config_from_args
from pystronghold.train.model_spec import LORA_LR, model_lr
from pystronghold.train.run import peak_lr
from train_helpers import TINY, tiny_config

# Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1, "Learning Rate" column
GPT3_TABLE_2_1 = {"gpt3-125m": 6.0e-4, "gpt3-350m": 3.0e-4, "gpt3-760m": 2.5e-4, "gpt3-1.3b": 2.0e-4,
                  "gpt3-2.7b": 1.6e-4, "gpt3-6.7b": 1.2e-4, "gpt3-13b": 1.0e-4, "gpt3-175b": 0.6e-4}


def test_every_preset_has_its_published_lr():
    assert set(PRESET_LR) == set(PRESETS)
    for name, lr in GPT3_TABLE_2_1.items():
        assert PRESET_LR[name] == lr, name
    assert PRESET_LR["gpt2-124m"] == 6e-4  # nanoGPT's / GPT-3 Small's value for the same shape
    assert PRESET_LR["tiny"] == PRESET_LR["mini"] == PRESET_LR["small"] == SMALL_MODEL_LR == 2e-3


def _config(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("model", ["gpt3-125m", "gpt3-1.3b", "gpt3-6.7b", "gpt3-175b", "gpt2-124m", "tiny"])
def test_cli_lr_defaults_to_the_models(model):
    config = _config(["--model", model])
    assert config.optim.lr is None
    assert peak_lr(config) == PRESET_LR[model]


def test_demo_keeps_its_lr_and_an_explicit_lr_wins():
    assert peak_lr(_config([])) == SMALL_MODEL_LR
    assert peak_lr(_config(["--model", "gpt3-6.7b", "--lr", "3e-5"])) == 3e-5


def test_json_model_lr_key_or_size_class(tmp_path):
    with_lr = tmp_path / "with.json"
    with_lr.write_text(json.dumps(dict(TINY, lr=5e-3)))
    assert model_lr(str(with_lr)) == 5e-3
    assert resolve(_config(["--model", str(with_lr)])).model.layers == TINY["layers"]  # "lr" is not a GPTConfig field
    without = tmp_path / "without.json"
    without.write_text(json.dumps(TINY))
    assert model_lr(str(without)) == SMALL_MODEL_LR
    # a JSON file of a preset's shape gets the lr of that GPT-3 size
    big = PRESETS["gpt3-6.7b"]
    shaped = tmp_path / "shaped.json"
    shaped.write_text(json.dumps({k: getattr(big, k) for k in ("vocab_size", "vocab_pad_multiple", "seq_len",
                                                               "layers", "hidden", "heads", "tie_embeddings")}))
    assert model_lr(str(shaped)) == 1.2e-4


def test_recommended_lr_steps_down_with_size():
    names = sorted(GPT3_TABLE_2_1, key=lambda k: param_count(PRESETS[k]))
    assert [recommended_lr(PRESETS[n]) for n in names] == [GPT3_TABLE_2_1[n] for n in names]
    assert recommended_lr(PRESETS["small"]) == SMALL_MODEL_LR


@pytest.mark.parametrize("lr", [0, -1e-3, "big", True])
def test_bad_json_lr_is_refused(tmp_path, lr):
    f = tmp_path / "m.json"
    f.write_text(json.dumps(dict(TINY, lr=lr)))
    with pytest.raises(ValueError, match='--model: .*"lr" must be a number > 0'):
        model_lr(str(f))
    with pytest.raises(ValueError, match='"lr" must be'):
        resolve(_config(["--model", str(f)]))


def test_trainer_uses_the_models_lr(tmp_path):
    config = tiny_config(tmp_path, steps=1, model=dict(TINY, lr=7e-3))
    config.optim.lr = None
    trainer = Trainer(resolve(config))
    try:
        assert trainer.scheduler.base_lrs == [7e-3] * 2  # both param groups (--decay matrices)
    finally:
        trainer.close()
    config.optim.lr = 1e-4  # an explicit --lr wins over the model's
    trainer = Trainer(resolve(config))
    try:
        assert trainer.scheduler.base_lrs == [1e-4] * 2
    finally:
        trainer.close()


@pytest.mark.parametrize("model", ["tiny", "gpt2-124m"])
def test_lora_defaults_to_the_lora_rate_and_an_explicit_lr_wins(peft, model):
    assert peak_lr(_config(["--model", model])) == PRESET_LR[model]
    assert peak_lr(_config(["--model", model, "--lora-rank", "4"])) == LORA_LR == 2e-4
    assert peak_lr(_config(["--model", model, "--lora-rank", "4", "--lr", "3e-5"])) == 3e-5
