"""What trains and what it costs the planner: the whole model, LoRA adapters on a frozen base, or
all but the frozen parameters, split into trainable and frozen parameter counts (``ParamSplit``).

A frozen parameter costs its value once in the compute dtype (2 bytes in bf16/fp16, 4 in fp32)
in the store and the window slot, and nothing else; a trainable one costs full fine-tuning's 16
bytes of host store. Blocks lay out trainable parameters first. ``settings.finetune.FinetuneOptions``
decides: ``lora_rank`` R adds R·(in + out) trainable parameters per targeted (out, in) weight as
PEFT's ``LoraConfig`` does and freezes the base; ``freeze`` freezes parameters whose full name
matches a regular expression (``re.search``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pystronghold.models.gpt import GPTConfig
from pystronghold.models.lora import GPT_LORA_DEFAULT_TARGETS, GPT_NOT_ADAPTABLE, default_lora_targets
from pystronghold.options import ConfigError
from pystronghold.planner.params import (active_matmul_numel, block_param_shapes, block_prefix,
                                         head_tail_param_shapes, numel)
from pystronghold.settings.finetune import FinetuneOptions

__all__ = ["ParamSplit", "lora_targets", "check_lora_targets", "param_split",
           "check_freeze"]

@dataclass(frozen=True, slots=True)
class ParamSplit:
    """One block's parameters (on one rank) and the head and tail's, split into trainable and frozen."""

    block_trainable: tuple[int, ...]
    """Elements of each trainable parameter of a block, in the order the runtime lays them out
    (LoRA: the adapters, A then B of each target in block order)."""
    block_frozen: tuple[int, ...]
    """Elements of each frozen parameter of a block, after the trainable ones."""
    block_frozen_matmul: int
    """Elements of a block's frozen matrices one token multiplies by (``active_matmul_numel``):
    their weight gradients are not computed."""
    block_adapters: int
    """LoRA parameters of one block (0 without LoRA)."""
    head_tail_trainable: int
    """Trainable parameters of head and tail (LoRA adapters of head/tail targets included)."""
    head_tail_frozen: int
    """Frozen parameters of head and tail."""
    lm_head_frozen: bool
    """The LM head's weight is frozen (its weight gradient is not computed)."""

    @property
    def block_params(self) -> int:
        """Parameters of one block, frozen and trainable (what one load moves)."""
        return sum(self.block_trainable) + sum(self.block_frozen)


def lora_targets(config, finetune: FinetuneOptions) -> tuple[str, ...]:
    """The module names LoRA adapts: ``finetune.lora_targets`` or the family's default
    (``models.lora.default_lora_targets``, as training resolves it)."""
    if finetune.lora_targets is not None:
        return finetune.lora_targets
    if isinstance(config, GPTConfig):
        return GPT_LORA_DEFAULT_TARGETS
    modules = [_module(name) for name, shape in block_param_shapes(config) if name.endswith(".weight") and len(shape) == 2]
    return default_lora_targets(config.model_type, modules)


def _module(param_name: str) -> str:
    return param_name.rpartition(".")[0]


def _targeted(module: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of ``target_modules``: the name is a target or ends with ``.target``."""
    return any(module == t or module.endswith("." + t) for t in targets)


def _adapters(shapes, targets: tuple[str, ...], rank: int, fan_in_fan_out: bool) -> list[int]:
    """Elements of the A and B of each targeted matrix weight of ``shapes``: R·in, out·R (weights
    are (out, in), or (in, out) with ``fan_in_fan_out``)."""
    out = []
    for name, shape in shapes:
        if name.endswith(".weight") and len(shape) == 2 and _targeted(_module(name), targets):
            fan_out, fan_in = reversed(shape) if fan_in_fan_out else shape
            out += [rank * fan_in, fan_out * rank]
    return out


def check_lora_targets(config, targets: tuple[str, ...]) -> None:
    """ConfigError (one line) for a target that names no layer of the model LoRA can adapt: a matrix
    weight's (of pystronghold's GPT, not ``models.lora.GPT_NOT_ADAPTABLE``)."""
    shapes = block_param_shapes(config) + head_tail_param_shapes(config)
    skip = GPT_NOT_ADAPTABLE if isinstance(config, GPTConfig) else ()
    modules = [_module(name) for name, shape in shapes
               if name.endswith(".weight") and len(shape) == 2 and _module(name) not in skip]
    for t in targets:
        if not _targeted_any(t, modules):
            others = {_module(name) for name, _ in shapes}
            what = "is not a linear layer" if _targeted_any(t, others) else "names no module of the model"
            raise ConfigError(f"--lora-targets: {t!r} {what}; its linear layers: "
                              f"{', '.join(sorted({m.rpartition('.')[2] for m in modules}))}")


def _targeted_any(target: str, modules) -> bool:
    return any(_targeted(m, (target,)) for m in modules)


def param_split(config, finetune: FinetuneOptions) -> ParamSplit:
    """The ``ParamSplit`` of ``config`` fine-tuned as ``finetune`` (``--freeze``: as it matches
    block 0; ``check_freeze`` checks that it matches every block alike). ConfigError (one line) for
    a LoRA target that is no linear layer of the model, or a GPT's tensor parallelism with a frozen
    part. A Hugging Face model's adapters are counted on its per-rank shapes: sharded with their base
    layer (a colwise layer's B and a rowwise layer's A split, the other replicated)."""
    block, head_tail = block_param_shapes(config), head_tail_param_shapes(config)
    if finetune.full:
        return ParamSplit(block_trainable=tuple(numel(s) for _, s in block), block_frozen=(),
                          block_frozen_matmul=0, block_adapters=0,
                          head_tail_trainable=sum(numel(s) for _, s in head_tail), head_tail_frozen=0,
                          lm_head_frozen=False)
    if config.tp_size != 1 and isinstance(config, GPTConfig):  # NOTE: our GPT's LoRA does not run at --tp
        raise ConfigError("the planner costs LoRA and frozen parameters of a GPT at tensor parallelism 1 only (--tp 1)")
    vocab_rows = config.padded_vocab_size // config.tp_size
    lm_head = [name for name, s in head_tail if len(s) == 2 and s[0] == vocab_rows][-1]
    if finetune.lora_rank is not None:
        targets = lora_targets(config, finetune)
        check_lora_targets(config, targets)
        fan_in_fan_out = getattr(config, "fan_in_fan_out", False)
        adapters = _adapters(block, targets, finetune.lora_rank, fan_in_fan_out)
        return ParamSplit(block_trainable=tuple(adapters), block_frozen=tuple(numel(s) for _, s in block),
                          block_frozen_matmul=active_matmul_numel(config, block),
                          block_adapters=sum(adapters),
                          head_tail_trainable=sum(_adapters(head_tail, targets, finetune.lora_rank,
                                                            fan_in_fan_out)),
                          head_tail_frozen=sum(numel(s) for _, s in head_tail), lm_head_frozen=True)
    pattern, prefix = re.compile(finetune.freeze), block_prefix(config, 0)
    frozen = [bool(pattern.search(prefix + name)) for name, _ in block]
    frozen_head_tail = {name for name, _ in head_tail if pattern.search(name)}
    return ParamSplit(
        block_trainable=tuple(numel(s) for (_, s), f in zip(block, frozen) if not f),
        block_frozen=tuple(numel(s) for (_, s), f in zip(block, frozen) if f),
        block_frozen_matmul=active_matmul_numel(config, [p for p, f in zip(block, frozen) if f]),
        block_adapters=0,
        head_tail_trainable=sum(numel(s) for name, s in head_tail if name not in frozen_head_tail),
        head_tail_frozen=sum(numel(s) for name, s in head_tail if name in frozen_head_tail),
        lm_head_frozen=lm_head in frozen_head_tail)


def check_freeze(config, finetune: FinetuneOptions) -> None:
    """ConfigError (one line) when ``finetune.freeze`` matches no parameter of ``config``, or
    freezes different parameters in different blocks (the planner costs identical blocks)."""
    if finetune.freeze is None:
        return
    pattern = re.compile(finetune.freeze)
    names = [name for name, _ in block_param_shapes(config)]
    first = [bool(pattern.search(block_prefix(config, 0) + n)) for n in names]
    for i in range(1, config.layers):
        frozen = [bool(pattern.search(block_prefix(config, i) + n)) for n in names]
        if frozen != first:
            raise ConfigError(f"--freeze '{finetune.freeze}' freezes {sum(first)} of block 0's {len(names)} "
                              f"parameters but {sum(frozen)} of block {i}'s; the planner costs identical "
                              "blocks: freeze the same parameters in every block")
    if not any(first) and not any(pattern.search(name) for name, _ in head_tail_param_shapes(config)):
        raise ConfigError(f"--freeze '{finetune.freeze}' matches no parameter (names look like "
                          f"{block_prefix(config, 0)}{names[0]})")
