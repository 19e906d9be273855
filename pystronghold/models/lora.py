"""LoRA adapters on a model built one block at a time (``pystronghold train --lora-rank R``): a
Hugging Face model (``--model hf:DIR``) or pystronghold's GPT, and the adapters in PEFT's format.

``add_lora`` wraps the model with ``peft.get_peft_model`` (``pip install 'pystronghold[peft]'``),
freezing every base weight. Block i's adapters get PEFT's initial values (A Kaiming-uniform, B
zero) when ``wrap`` materializes block i, from a generator seeded by ``(seed, i)``, independent of
block order. ``merged`` adds ``(alpha / r) B A`` to a base weight; ``merged_state_dict`` does it
to every adapted weight of a state dict. Saved as PEFT saves: ``adapter_config.json`` and
``adapter_model.safetensors``.
"""

from __future__ import annotations

import re
import threading
import warnings
from dataclasses import replace

import torch
from torch import nn

from pystronghold.models.gpt import GPT
from pystronghold.options import ConfigError, first_line
from pystronghold.settings.finetune import LoraSpec

__all__ = ["ADAPTER", "PEFT_PREFIX", "GPT_ARCHITECTURE", "GPT_LORA_DEFAULT_TARGETS", "GPT_NOT_ADAPTABLE",
           "default_lora_targets", "add_lora", "lora_config", "adapter_key", "merged", "merged_state_dict"]

ADAPTER = "default"
"""The adapter's name in the model (PEFT's default): parameters are ``...lora_A.default.weight``."""
PEFT_PREFIX = "base_model.model."
"""What PEFT's wrappers (PeftModel, LoraModel) put before the base model's names."""
_FAN_IN_FAN_OUT = {"GPT2LMHeadModel"}
"""Architectures whose linear layers store their weights transposed (GPT-2's Conv1D)."""
_BASE_LAYER = ".base_layer."
"""PEFT moves a wrapped layer's own parameters under ``base_layer``; the base model names them without it."""
_ADAPTER_PART = re.compile(r"\.lora_(A|B)\." + ADAPTER + r"\.")
GPT_ARCHITECTURE = "GPT"
"""``lora_config``'s architecture of pystronghold's GPT."""
GPT_LORA_DEFAULT_TARGETS = ("qkv",)
"""LoRA targets of pystronghold's GPT when none are given: its fused attention input, as GPT-2's."""
GPT_NOT_ADAPTABLE = ("head.tok",)
"""Modules of pystronghold's GPT with a matrix weight that LoRA cannot adapt: the token embedding
(a ``VocabParallelEmbedding``, which PEFT does not know)."""
_ATTENTION_TARGETS = (("q_proj", "v_proj"), ("qkv_proj",), ("query_key_value",), ("c_attn",), ("Wqkv",),
                      ("query", "value"))
"""The attention's query and value projections under the names families give them, most specific
first: the default targets of a family PEFT has no default for (as PEFT's own defaults are)."""


def default_lora_targets(model_type: str, block_modules) -> tuple[str, ...]:
    """The LoRA targets of a Hugging Face family when none are given: PEFT's default for
    ``model_type`` (its ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``), else the block's
    attention query and value projections found by name among ``block_modules`` (the dotted names
    of one block's linear layers). ConfigError (one line) when neither gives any."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_defaults

    if model_type in peft_defaults:
        return tuple(peft_defaults[model_type])
    leaves = {name.rpartition(".")[2] for name in block_modules}
    for targets in _ATTENTION_TARGETS:
        if leaves.issuperset(targets):
            return targets
    raise ConfigError(f"--lora-rank: no default LoRA targets for {model_type!r} (PEFT has none and its attention "
                      f"has no q_proj/v_proj, qkv_proj, query_key_value or c_attn); give --lora-targets, one or "
                      f"more of: {', '.join(sorted(leaves))}")


def lora_config(spec: LoraSpec, architecture: str, base: str | None = None):
    """PEFT's ``LoraConfig`` of ``spec`` for a causal LM of ``architecture`` (``GPT_ARCHITECTURE``:
    pystronghold's GPT) whose base model is the directory ``base``."""
    import peft

    gpt = architecture == GPT_ARCHITECTURE
    config = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                             target_modules=list(spec.targets) if spec.targets is not None else None,
                             fan_in_fan_out=architecture in _FAN_IN_FAN_OUT,
                             task_type=None if gpt else "CAUSAL_LM",  # the GPT's forward is its own
                             base_model_name_or_path=base)
    if gpt:
        from peft.tuners.lora.layer import Linear

        from pystronghold.parallel.layers import ColumnParallelLinear, RowParallelLinear

        # NOTE: PEFT's experimental dispatch of custom layers; its Linear adds B A x to the base
        # layer's output, right for these layers unsplit (tensor parallelism 1)
        config._register_custom_module({ColumnParallelLinear: Linear, RowParallelLinear: Linear})
    return config


def add_lora(owner, spec: LoraSpec, seed: int) -> tuple[nn.Module, LoraSpec]:
    """Wrap the model of ``owner`` with PEFT LoRA adapters: a ``models.hf.LazyHFModel`` (its
    ``model``, blocks on meta) or pystronghold's ``GPT`` (blocks on meta or not; targets default to
    ``GPT_LORA_DEFAULT_TARGETS``). Sets ``owner.adapters`` so that materializing block i
    (``LazyHFModel.materialize(i)``, ``GPT.materialize_block_(i)``) initialises its adapters.
    Returns the PEFT model (what ``wrap`` takes; its blocks are ``owner.blocks``) and the spec with
    the targets PEFT resolved. ConfigError (one line) for targets the model does not have, or a GPT
    split by tensor parallelism."""
    import peft

    if isinstance(owner, GPT):
        if owner.config.tp_size != 1:
            raise ConfigError("--lora-rank: pystronghold's GPT takes LoRA adapters at tensor parallelism 1 only")
        model, config = owner, lora_config(replace(spec, targets=spec.targets or GPT_LORA_DEFAULT_TARGETS),
                                           GPT_ARCHITECTURE)
    else:
        from pystronghold.models.lora_tp import TP_LORA_LAYERS

        if spec.targets is None:
            linear = [name for name, m in owner.blocks[0].named_modules()
                      if isinstance(m, (nn.Linear, *TP_LORA_LAYERS)) or type(m).__name__ == "Conv1D"]
            spec = replace(spec, targets=default_lora_targets(owner.spec.model_type, linear))
        model, config = owner.model, lora_config(spec, owner.spec.architecture, owner.spec.source)
        # NOTE: a model split by --tp (models.hf_tp) has parallel layers, whose adapters split with them
        config._register_custom_module(TP_LORA_LAYERS)
    try:
        with warnings.catch_warnings():  # NOTE: PEFT warns of every layer its custom dispatch wraps
            warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
            # NOTE: PeftModel asks the model's is_gradient_checkpointing, which transformers 5
            # deprecates; the warning is addressed to PEFT, and would print on every LoRA run
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning, module=r"transformers\.")
            model = peft.get_peft_model(model, config)
    except ValueError as e:  # PEFT: "Target modules {...} not found in the base model. ..."
        raise ConfigError(f"--lora-targets: {first_line(e)}") from None
    owner.adapters = _BlockAdapters(seed)
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

    _drawing = threading.Lock()
    """NOTE: PEFT draws from torch's global generator, so one block at a time draws (``wrap``
    materializes a GPT's blocks in parallel threads), each from its own seed."""

    @torch.no_grad()
    def initialize(self, block: nn.Module, index: int) -> None:
        """Give block ``index``'s adapters storage on the host and PEFT's initial values."""
        with self._drawing, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + index)
            for module in block.modules():
                lora_a = getattr(module, "lora_A", None)
                if not isinstance(lora_a, nn.ModuleDict) or ADAPTER not in lora_a:
                    continue
                _empty_on_host(lora_a[ADAPTER])
                _empty_on_host(module.lora_B[ADAPTER])
                module.reset_lora_parameters(ADAPTER, init_lora_weights=True)


def _empty_on_host(module: nn.Module) -> None:
    """``module.to_empty(device="cpu")`` that keeps a split parameter's ``tp_split`` (``models.lora_tp``):
    to_empty makes new parameters of a meta module's, without the attributes."""
    for name, p in list(module.named_parameters(recurse=False)):
        host = nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if hasattr(p, "tp_split"):
            host.tp_split = p.tp_split
        setattr(module, name, host)


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


_ADAPTER_PAIRS = ((f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", False),
                  (f".lora_embedding_A.{ADAPTER}", f".lora_embedding_B.{ADAPTER}", True))
"""(A's suffix, B's suffix, the delta is transposed) of a LoRA linear layer's and embedding's adapters."""


def merged_state_dict(weights: dict[str, torch.Tensor], spec: LoraSpec, architecture: str) -> dict[str, torch.Tensor]:
    """The base model's state dict of a PEFT LoRA model's ``weights`` (every parameter, by PEFT's
    names): each adapted weight with its adapters merged (``merged``, fp32), under the base model's
    names (``PEFT_PREFIX`` and ``base_layer`` dropped). ValueError when an adapter has no weight."""
    adapters = {name for name in weights if any(name.endswith(a) or name.endswith(b) for a, b, _ in _ADAPTER_PAIRS)}
    out, used = {}, set()
    for name, tensor in weights.items():
        if name in adapters:
            continue
        if name.endswith(_BASE_LAYER + "weight"):
            module = name.removesuffix(_BASE_LAYER + "weight")
            for a, b, transposed in _ADAPTER_PAIRS:
                if module + a in weights:
                    lora_a, lora_b = weights[module + a], weights[module + b]
                    if transposed:  # an embedding's A is (r, rows), B (cols, r): its delta is (B A)^T
                        lora_a, lora_b = lora_b.T, lora_a.T
                    tensor = merged(tensor, lora_a, lora_b, spec, architecture)
                    used |= {module + a, module + b}
        out[name.removeprefix(PEFT_PREFIX).replace(_BASE_LAYER, ".")] = tensor
    if used != adapters:
        raise ValueError(f"LoRA merge: adapters without a base weight: {', '.join(sorted(adapters - used)[:3])}")
    return out
