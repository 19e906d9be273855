"""LoRA adapters on a Hugging Face model loaded one block at a time (``pystronghold train --model
hf:DIR --lora-rank R``), and the adapters in PEFT's format.

PEFT (``pip install 'pystronghold[peft]'``) makes the adapters: ``add_lora`` wraps the model of
``models.hf.load_lazy`` with ``peft.get_peft_model``, which freezes every base weight. The blocks
are still on ``meta`` then, and PEFT puts a meta layer's adapters on meta too; so block i's
adapters get their initial values when ``wrap`` materializes block i, right after its base weights
are read from the shards: PEFT's own initialisation (A Kaiming-uniform, B zero: the model starts as
the base) drawn from a generator seeded by ``(seed, i)``, the same whatever the order of blocks.

The format PEFT saves (``save_pretrained``, loaded by ``PeftModel.from_pretrained``):
``adapter_config.json`` (the ``LoraConfig``) and ``adapter_model.safetensors`` holding the adapter
tensors under the model's names with the adapter's name dropped (``...q_proj.lora_A.weight``).
``merged`` adds ``(alpha / r) B A`` to a base weight (``merge_and_unload``'s arithmetic).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch
from torch import nn

__all__ = ["LoraSpec", "ADAPTER", "PEFT_PREFIX", "GPT_LORA_DEFAULT_TARGETS", "GPT_NOT_ADAPTABLE", "add_lora",
           "lora_config", "adapter_key", "merged"]

ADAPTER = "default"
"""The adapter's name in the model (PEFT's default): parameters are ``...lora_A.default.weight``."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's wrappers (PeftModel, LoraModel) put before the base model's names."""
_FAN_IN_FAN_OUT = {"GPT2LMHeadModel"}
"""Architectures whose linear layers store their weights transposed (GPT-2's Conv1D)."""
_BASE_LAYER = ".base_layer."
"""PEFT moves a wrapped layer's own parameters under ``base_layer``; the base model names them without it."""
_ADAPTER_PART = re.compile(r"\.lora_(A|B)\." + ADAPTER + r"\.")
GPT_LORA_DEFAULT_TARGETS = ("qkv",)
"""LoRA targets of pystronghold's GPT when none are given: its fused attention input, as GPT-2's."""
GPT_NOT_ADAPTABLE = ("head.tok",)
"""Modules of pystronghold's GPT with a matrix weight that LoRA cannot adapt: the token embedding
(a ``VocabParallelEmbedding``, which PEFT does not know)."""


@dataclass(kw_only=True, slots=True)
class LoraSpec:
    """The adapters of a run, as its checkpoints record them."""

    rank: int
    """r: the adapters' inner dimension."""
    alpha: float
    """lora_alpha: the update is scaled by alpha / rank."""
    targets: tuple[str, ...] | None = None
    """Names of the modules adapted (PEFT's ``target_modules``: a module whose name ends with one);
    None: PEFT's default for the architecture (q_proj and v_proj for Llama, c_attn for GPT-2)."""
    dropout: float = 0.0
    """lora_dropout: dropout on the adapters' input during training."""

    def record(self) -> dict:
        """JSON-able fields, targets sorted."""
        return dict(asdict(self), targets=sorted(self.targets) if self.targets is not None else None)


def lora_config(spec: LoraSpec, architecture: str, base: str | None = None):
    """PEFT's ``LoraConfig`` of ``spec`` for a causal LM of ``architecture`` whose base model is the
    directory ``base``."""
    import peft

    return peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                           target_modules=list(spec.targets) if spec.targets is not None else None,
                           fan_in_fan_out=architecture in _FAN_IN_FAN_OUT, task_type="CAUSAL_LM",
                           base_model_name_or_path=base)


def add_lora(lazy, spec: LoraSpec, seed: int) -> tuple[nn.Module, LoraSpec]:
    """Wrap ``lazy.model`` (``models.hf.LazyHFModel``, blocks on meta) with PEFT LoRA adapters and
    set ``lazy.adapters`` so that ``lazy.materialize(i)`` initialises block i's. Returns the PEFT
    model (what ``wrap`` takes; its blocks are ``lazy.blocks``) and the spec with the targets PEFT
    resolved. ValueError (one line) for targets the model does not have."""
    import peft

    try:
        model = peft.get_peft_model(lazy.model, lora_config(spec, lazy.spec.architecture, lazy.spec.source))
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model. ..."
        raise ValueError(f"--lora-targets: {str(e).splitlines()[0]}") from None
    lazy.adapters = _BlockAdapters(seed)
    targets = tuple(sorted(model.peft_config[ADAPTER].target_modules))
    return model, LoraSpec(rank=spec.rank, alpha=spec.alpha, targets=targets, dropout=spec.dropout)


class _BlockAdapters:
    """What ``LazyHFModel.materialize`` asks of the adapters of a PEFT-wrapped model."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    @staticmethod
    def stored_name(name: str) -> str | None:
        """The base model's name of parameter ``name`` (as the shards hold it); None for an adapter's."""
        return None if _ADAPTER_PART.search(name) else name.replace(_BASE_LAYER, ".")

    @torch.no_grad()
    def initialize(self, block: nn.Module, index: int) -> None:
        """Give block ``index``'s adapters storage on the host and PEFT's initial values."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + index)
            for module in block.modules():
                lora_a = getattr(module, "lora_A", None)
                if not isinstance(lora_a, nn.ModuleDict) or ADAPTER not in lora_a:
                    continue
                lora_a[ADAPTER].to_empty(device="cpu")
                module.lora_B[ADAPTER].to_empty(device="cpu")
                module.reset_lora_parameters(ADAPTER, init_lora_weights=True)


# ---- PEFT's format

def adapter_key(name: str) -> str:
    """PEFT's saved name of the model's adapter parameter ``name``: the adapter's name dropped, as
    ``get_peft_model_state_dict`` does (``...lora_A.default.weight`` -> ``...lora_A.weight``)."""
    return name.replace(f".{ADAPTER}", "")


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, spec: LoraSpec,
           architecture: str) -> torch.Tensor:
    """``weight + (alpha / r) B A`` in fp32 (transposed for a Conv1D weight), as PEFT's merge."""
    delta = (lora_b.float() @ lora_a.float()) * (spec.alpha / spec.rank)  # (out, in)
    return weight.float() + (delta.T if architecture in _FAN_IN_FAN_OUT else delta)
