"""Which parameters of a model train, as settings: the fine-tune options ``pystronghold train`` and
``pystronghold plan`` share (``FinetuneOptions``, a component of ``TrainConfig`` and of
``PlanRequest``) and the adapters they ask for (``LoraSpec``, as checkpoints record them).

The adapters themselves are ``models/lora.py``'s, their costs ``planner/trainable.py``'s.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from pystronghold.options import ConfigError, option

__all__ = ["FinetuneOptions", "LoraSpec"]

_MODULE_NAME = re.compile(r"[A-Za-z0-9_.]+")


def _names(text: str, flag: str) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); ConfigError naming ``flag`` for anything else."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(_MODULE_NAME.fullmatch(n) for n in names):
        raise ConfigError(f"{flag} must be comma-separated module names like q_proj,v_proj, got {text!r}")
    return names


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

    @classmethod
    def from_record(cls, record: dict) -> LoraSpec:
        """The spec of ``record()``'s fields (a checkpoint manifest's)."""
        targets = record.get("targets")
        return cls(**dict(record, targets=tuple(targets) if targets is not None else None))


@dataclass(frozen=True, kw_only=True, slots=True)
class FinetuneOptions:
    """Which parameters train: LoRA adapters, or all but the frozen ones (default: all of them)."""

    lora_rank: int | None = option(None, metavar="R")
    """Train LoRA adapters of rank R (PEFT's LoraConfig r) instead of the model's weights: every
    base parameter is frozen (stored once in the compute dtype, 2 B/param in bf16, no optimizer
    state), adapters A (R x in) and B (out x R) on each --lora-targets layer train (training needs
    pip install 'pystronghold[peft]'). export --hf of a --model hf:DIR run writes the adapters in
    PEFT's format (with --merge the merged model); export of a GPT run, the merged model. In plan,
    the largest-model table is then the largest LoRA fine-tune."""
    lora_alpha: float | None = None
    """LoRA alpha: the adapters' update is scaled by alpha / rank; default 2 x --lora-rank (a scale of 2)."""
    lora_targets: tuple[str, ...] | None = option(None, parse=_names, metavar="NAME,...")
    """Comma-separated layers LoRA adapts, as PEFT's target_modules (a module whose name is or ends
    with .NAME, e.g. q_proj,v_proj,down_proj). Default: PEFT's for the family (q_proj,v_proj for
    Llama, c_attn for GPT-2, ...), else the attention's query and value projections found by name
    (``models.lora.default_lora_targets``); qkv for pystronghold's GPT."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's lora_dropout), in [0, 1)."""
    freeze: str | None = option(None, metavar="REGEX")
    """Freeze the parameters whose full name matches this regular expression (re.search on names such
    as blocks.3.attn.qkv.weight, head.tok.weight, model.layers.3.mlp.up_proj.weight), e.g.
    'embed|layers\\.[0-9]\\.' to train a Llama's layers from 10 up: they keep their values, stored
    once in the compute dtype with no optimizer state (a checkpoint of a --model hf:DIR run leaves
    them to DIR); the rest train. Not with --lora-rank."""

    def __post_init__(self) -> None:
        r = self.lora_rank
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ConfigError(self, "lora_rank=", "must be a positive integer (the rank R of the adapters)")
        if r is None:
            for name in ("lora_alpha", "lora_targets", "lora_dropout"):
                if getattr(self, name) not in (None, 0.0):
                    raise ConfigError(self, name, "needs `lora_rank`")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ConfigError(self, "lora_alpha=", "must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(self, "lora_dropout=", "must be in [0, 1)")
        if self.lora_targets is not None and (
                not isinstance(self.lora_targets, tuple) or not self.lora_targets
                or not all(isinstance(t, str) and _MODULE_NAME.fullmatch(t) for t in self.lora_targets)):
            raise ConfigError(self, "lora_targets", f"must name layers, like q_proj,v_proj; got {self.lora_targets!r}")
        if self.freeze is not None:
            if r is not None:
                raise ConfigError(self, "freeze", "and `lora_rank` exclude each other: LoRA already freezes "
                                  "every parameter of the base model")
            try:
                re.compile(self.freeze)
            except re.error as e:
                raise ConfigError(self, "freeze", f"is not a regular expression ({e}): {self.freeze!r}") from None

    @property
    def full(self) -> bool:
        """Every parameter trains."""
        return self.lora_rank is None and self.freeze is None

    @property
    def lora(self) -> LoraSpec | None:
        """The adapters asked for (targets None: the architecture's default), or None without --lora-rank."""
        if self.lora_rank is None:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return LoraSpec(rank=self.lora_rank, alpha=alpha, targets=self.lora_targets, dropout=self.lora_dropout)
