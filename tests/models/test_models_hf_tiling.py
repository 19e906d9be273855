"""Hugging Face MLPs over tiles of the sequence (``models.hf_tiling.tile_mlps``) and attention
through SDPA: which of the tested families tile (the MLP is a dense position-wise module), with the
untiled logits bit for bit and gradients within 1e-6 (bf16: one rounding); loading asks for SDPA;
and an unpadded causal batch at 4K tokens makes no tensor near T x T, forward or backward."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_models import FAMILIES, MOE_FAMILIES, save_tiny
from pystronghold.models.hf import load_lazy
from pystronghold.models.hf_tiling import tile_mlps

transformers = pytest.importorskip("transformers")

UNTILED = {"opt": "no MLP child: fc1 and fc2 sit in the decoder layer",
           "bloom": "its MLP adds the residual itself (two arguments)",
           **{family: "a mixture of experts" for family in MOE_FAMILIES}}
"""The tested families whose MLPs stay untiled, and why; every other family tiles all its blocks."""

T_BY_T = {"gemma2": "eager attention (soft-capped scores)", "gptj": "eager attention", "bloom": "eager attention (ALiBi)",
          "falcon": "transformers always makes its mask (for ALiBi, even without)",
          "gpt2": "attention dropout: SDPA's math kernel on the CPU", "gpt_bigcode": "attention dropout, as GPT-2",
          "mistral": "a sliding window once T reaches it (SDPA has none: the mask is made)",
          "gemma3_text": "sliding-window layers, as Mistral",
          "qwen2_moe": "transformers makes the sliding-window mask of every batch, used or not (window 0 here)"}
"""The tested families whose training forward still makes T x T tensors with the installed transformers
at T = 4096 (the tiny Mistral's and Gemma 3's window is 4096)."""


def _model(family, dtype=torch.float32):
    config = transformers.AutoConfig.for_model(family, **FAMILIES[family])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _logits_and_grads(model, x):
    model.zero_grad()
    logits = model(input_ids=x).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_which_families_tile_and_their_tiled_mlps_are_exact(family):
    """Every block of a family not in UNTILED tiles; logits are the untiled ones bit for bit,
    gradients within 1e-6 (dropout off: eval mode, so the two runs draw nothing)."""
    model = _model(family).eval()
    x = torch.randint(0, 300, (2, 40))
    want, want_grads = _logits_and_grads(model, x)
    count = tile_mlps(model, 16)  # tiles of 16, 16 and 8 positions
    assert count == (0 if family in UNTILED else model.config.num_hidden_layers)
    got, got_grads = _logits_and_grads(model, x)
    assert torch.equal(got, want)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _rel(got_grads[name], grad) <= 1e-6, name


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_bf16_tiled_mlps_are_the_untiled_ones_within_one_rounding(family):
    model = _model(family, torch.bfloat16).train()
    tiled = copy.deepcopy(model)
    assert tile_mlps(tiled, 12) == model.config.num_hidden_layers
    x = torch.randint(0, 300, (2, 40))
    want, want_grads = _logits_and_grads(model, x)
    got, got_grads = _logits_and_grads(tiled, x)
    assert torch.equal(got, want)
    for name, grad in want_grads.items():
        # NOTE: an MLP weight's gradient is a sum over tiles: its bf16 rounding differs by an ulp here and there
        assert _rel(got_grads[name], grad) <= 1e-2, name


def test_tiling_off_again_and_a_new_tile():
    model = _model("llama").eval()
    x = torch.randint(0, 300, (1, 30))
    mlp = model.model.layers[0].mlp
    assert tile_mlps(model, 8) == 3 and "forward" in vars(mlp)
    assert tile_mlps(model, 10) == 3 and vars(mlp)["forward"].tile == 10
    assert tile_mlps(model, 0) == 0 and "forward" not in vars(mlp)
    with pytest.raises(ValueError, match="tile_tokens must be an int >= 0"):
        tile_mlps(model, -1)
    assert model(input_ids=x).logits.shape == (1, 30, 300)


def test_loading_asks_for_sdpa_whatever_config_json_says(tmp_path):
    directory = save_tiny(tmp_path, "llama", tokenizer=False)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, attn_implementation="eager")))
    assert load_lazy(directory).model.config._attn_implementation == "sdpa"
    # a family without SDPA in the installed transformers keeps eager (Gemma 2 has it from some 5.x
    # releases on and not in others: the check follows the installed version's own flag)
    from transformers.models.gemma2.modeling_gemma2 import Gemma2PreTrainedModel

    want = "sdpa" if Gemma2PreTrainedModel._supports_sdpa else "eager"
    assert load_lazy(save_tiny(tmp_path, "gemma2", tokenizer=False)).model.config._attn_implementation == want


class _LargestTensor(TorchDispatchMode):
    """The most bytes of any tensor an op makes while active."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.op = t.numel() * t.element_size(), f"{func} {tuple(t.shape)}"
        return out


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(T_BY_T)))
def test_an_unpadded_causal_batch_makes_no_t_by_t_tensor(tmp_path, family):
    """Loaded as ``hf:DIR`` is (SDPA), trained on 4,096 tokens: no mask and no scores of T x T, in
    the forward or the backward (the largest tensor is the logits, T x 300 x 4 bytes)."""
    T = 4096
    overrides = {key: T for key in ("max_position_embeddings", "n_positions") if key in FAMILIES[family]}
    config = transformers.AutoConfig.for_model(family, **dict(FAMILIES[family], **overrides))
    directory = tmp_path / family
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    lazy = load_lazy(directory)
    for i in range(len(lazy.blocks)):
        lazy.materialize(i)
    model = lazy.model.train()
    x = torch.randint(0, 300, (1, T))
    with _LargestTensor() as seen:
        model(input_ids=x).logits.float().sum().backward()
    assert seen.bytes <= T * T * 4 // 8, seen.op


@pytest.mark.parametrize("family", sorted(T_BY_T))
def test_the_families_listed_with_t_by_t_tensors_still_make_them(family):
    """So that T_BY_T stays true: a family that stops making them leaves the list (at 512 tokens, a
    sliding window of 128)."""
    T = 512
    overrides = {key: T for key in ("max_position_embeddings", "n_positions") if key in FAMILIES[family]}
    config = transformers.AutoConfig.for_model(family, **dict(FAMILIES[family], **overrides))
    if getattr(config, "sliding_window", None):
        config.sliding_window = 128
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    with _LargestTensor() as seen:
        model(input_ids=torch.randint(0, 300, (1, T)))
    assert seen.bytes >= T * T, seen.op
