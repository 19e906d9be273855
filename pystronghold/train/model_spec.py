"""Which model ``pystronghold train --model NAME`` trains, and the learning rate it defaults to.

``NAME`` is ``demo`` (``DEMO_MODEL``), a preset of ``pystronghold.models.PRESETS``, a JSON file of
``GPTConfig`` fields (optionally with ``"lr"``), or ``hf:DIR`` (a Hugging Face model directory).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields

from pystronghold.models import GPTConfig
from pystronghold.models.hf import HF_PREFIX, HFModelConfig, read_hf_config
from pystronghold.models.presets import PRESET_LR, PRESETS, SMALL_MODEL_LR, recommended_lr
from pystronghold.options import ConfigError

__all__ = ["DEMO_MODEL", "HF_FINETUNE_LR", "LORA_LR", "resolve_model", "model_lr"]

DEMO_MODEL = GPTConfig(vocab_size=256, seq_len=128, layers=12, hidden=128, heads=4)
"""The demo GPT: 12 blocks of 198k parameters (2.4M in blocks), byte vocabulary. With W=2 the
device holds 2 of the 12 blocks; the resident model (weights, gradients, Adam state) would need
about 6x the window's bytes."""


def _read_model_file(name: str) -> dict:
    """The JSON object of a model file (GPTConfig fields and an optional ``"lr"``); ConfigError
    naming --model."""
    try:
        with open(name) as f:
            spec = json.load(f)
    except OSError as e:
        raise ConfigError(f"--model: cannot read {name}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--model: {name} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--model: {name} must hold a JSON object of GPTConfig fields")
    lr = spec.get("lr", 1.0)
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ConfigError(f"--model: {name}: \"lr\" must be a number > 0, got {lr!r}")
    return spec


def _is_model_file(name: str) -> bool:
    return name.endswith(".json") or os.path.sep in name


HF_FINETUNE_LR = 5e-5
"""Peak learning rate of a ``--model hf:DIR`` fine-tune without --lr: Hugging Face Trainer's default
(``TrainingArguments.learning_rate``); pre-training rates would wreck a trained model."""
LORA_LR = 2e-4
"""Peak learning rate of a ``--lora-rank`` run without --lr, whatever the model: TRL's and PEFT's LoRA
recipes' rate, about 10x a full fine-tune's (the adapters start at zero and are few; at
``HF_FINETUNE_LR`` the loss barely moves)."""

def resolve_model(name: str) -> GPTConfig | HFModelConfig:
    """``"demo"``, a preset name (``pystronghold.models.PRESETS``), a JSON file of GPTConfig fields,
    or ``hf:DIR``, a Hugging Face model directory (its ``HFModelConfig``). A JSON file may also
    hold ``"lr"``: the model's peak learning rate."""
    if name.startswith(HF_PREFIX):
        from pystronghold.extras import require

        try:
            require("hf", "--model hf:DIR")
        except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
            raise ValueError(str(e)) from None
        return read_hf_config(name[len(HF_PREFIX):])
    if name == "demo":
        return DEMO_MODEL
    if name in PRESETS:
        return PRESETS[name]
    if _is_model_file(name):
        spec = _read_model_file(name)
        spec.pop("lr", None)
        known = {f.name for f in fields(GPTConfig)}
        unknown = sorted(set(spec) - known)
        if "mlp_tile_tokens" in spec:  # NOTE: how the MLP runs, not what the model is
            raise ConfigError(f"--model: {name}: mlp_tile_tokens is a setting of the run, not of the model: "
                              "give --mlp-tile instead")
        if unknown:
            raise ConfigError(f"--model: {name} has unknown GPTConfig fields {unknown}")
        try:
            return GPTConfig(**spec)
        except TypeError as e:
            raise ConfigError(f"--model: {name}: {e}") from None
    raise ConfigError(f"--model: unknown preset {name!r}; choose 'demo', one of {', '.join(PRESETS)}, "
                      "or a JSON file of GPTConfig fields")


def model_lr(name: str, *, lora: bool = False) -> float:
    """The peak learning rate ``--lr`` defaults to for ``--model name``: ``LORA_LR`` when ``lora``
    (training LoRA adapters), else the demo's ``SMALL_MODEL_LR``, a preset's ``PRESET_LR`` entry
    (published values), a JSON file's ``"lr"``, else ``recommended_lr`` of its shape (the GPT-3 lr
    of its size class); ``hf:DIR``: ``HF_FINETUNE_LR`` (fine-tuning a trained model)."""
    if lora:
        return LORA_LR
    if name == "demo":
        return SMALL_MODEL_LR
    if name.startswith(HF_PREFIX):
        return HF_FINETUNE_LR
    if name in PRESET_LR:
        return PRESET_LR[name]
    if _is_model_file(name):
        lr = _read_model_file(name).get("lr")
        if lr is not None:
            return float(lr)
    return recommended_lr(resolve_model(name))
