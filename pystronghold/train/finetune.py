"""Which parameters a ``pystronghold train`` run trains: LoRA adapters (``--lora-rank``, made by
PEFT on a ``--model hf:DIR`` model: ``models/lora.py``), or every parameter but those ``--freeze
REGEX`` names. Frozen parameters (the LoRA base included) are stored once in the compute dtype,
with no optimizer state; a checkpoint of a ``--model hf:DIR`` run leaves them to DIR
(``checkpoint.py``), and ``checkpoint_record`` is what it keeps to refuse resuming with other
options or a changed DIR (``check_checkpoint_record``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from pystronghold.models.lora import LoraSpec
from pystronghold.options import option

__all__ = ["FinetuneOptions", "freeze_matching", "checkpoint_record", "check_checkpoint_record", "check_base"]

_MODULE_NAME = re.compile(r"[A-Za-z0-9_.]+")


def _names(text: str, flag: str) -> tuple[str, ...]:
    """'q_proj,v_proj' -> ('q_proj', 'v_proj'); ValueError naming ``flag`` for anything else."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(_MODULE_NAME.fullmatch(n) for n in names):
        raise ValueError(f"{flag} must be comma-separated module names like q_proj,v_proj, got {text!r}")
    return names


@dataclass(kw_only=True, slots=True)
class FinetuneOptions:
    """Which parameters train: LoRA adapters, or all but the frozen ones."""

    lora_rank: int = 0
    """Train LoRA adapters of this rank (PEFT's LoraConfig r) on a --model hf:DIR model instead of
    its weights (needs pip install 'pystronghold[peft]'; pystronghold's GPT: use --freeze): the
    base is frozen, stored once in the compute dtype. export --hf writes the adapters in PEFT's
    format, with --merge the merged model. 0: no LoRA."""
    lora_alpha: float | None = None
    """LoRA alpha: the adapters' update is scaled by alpha / rank; default 2 x --lora-rank (a scale of 2)."""
    lora_targets: tuple[str, ...] | None = option(None, parse=_names, metavar="NAME,...")
    """Modules given adapters, comma-separated: those whose names end with one (e.g.
    q_proj,v_proj,down_proj); default PEFT's for the architecture (q_proj,v_proj for Llama,
    Mistral and Qwen2; c_attn for GPT-2)."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input while training (PEFT's lora_dropout), in [0, 1)."""
    freeze: str | None = option(None, metavar="REGEX")
    """Freeze the parameters whose full names match this regular expression (re.search), e.g.
    'embed|layers\\.[0-9]\\.' to train a Llama's layers from 10 up: they keep their values, stored
    once in the compute dtype with no optimizer state, and a checkpoint of a --model hf:DIR run
    leaves them to DIR. Not with --lora-rank."""

    def __post_init__(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be an int >= 0, got {self.lora_rank!r}")
        if not self.lora_rank:
            given = [flag for flag, value in (("--lora-alpha", self.lora_alpha), ("--lora-targets", self.lora_targets),
                                              ("--lora-dropout", self.lora_dropout or None)) if value is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} need --lora-rank R")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_targets is not None and not self.lora_targets:
            raise ValueError("--lora-targets must name at least one module")
        if self.freeze is not None:
            if self.lora_rank:
                raise ValueError("--freeze and --lora-rank: give one of them (LoRA freezes the whole base)")
            try:
                re.compile(self.freeze)
            except re.error as e:
                raise ValueError(f"--freeze {self.freeze!r} is not a regular expression: {e}") from None
        if self.lora_rank:
            from pystronghold.extras import require

            try:
                require("peft", "--lora-rank")
            except ImportError as e:  # NOTE: a ValueError is what the CLI reports as bad input
                raise ValueError(str(e)) from None

    @property
    def lora(self) -> LoraSpec | None:
        """The adapters asked for (targets None: PEFT's default), or None without --lora-rank."""
        if not self.lora_rank:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        return LoraSpec(rank=self.lora_rank, alpha=alpha, targets=self.lora_targets, dropout=self.lora_dropout)


def freeze_matching(model: nn.Module, pattern: str) -> int:
    """Set ``requires_grad=False`` on the parameters of ``model`` whose names ``pattern`` matches
    (``re.search``); returns how many. ValueError when it matches none or all of them."""
    regex = re.compile(pattern)
    named = list(model.named_parameters())
    matched = [p for name, p in named if regex.search(name)]
    if not matched:
        sample = ", ".join(name for name, _ in named[:3])
        raise ValueError(f"--freeze {pattern!r} matches no parameter (names look like {sample}, ...)")
    if len(matched) == len(named):
        raise ValueError(f"--freeze {pattern!r} matches every parameter: nothing would train")
    for p in matched:
        p.requires_grad_(False)
    return len(matched)


# ---- what a checkpoint records of the fine-tune, and the resume checks

def checkpoint_record(freeze: str | None, lora: LoraSpec | None, base_source: str | None) -> dict:
    """The manifest's entries of a run: ``finetune`` (the adapters, targets as PEFT resolved them,
    and the --freeze pattern) and, when the checkpoint leaves the frozen parameters to the base
    directory ``base_source``, ``base`` (its path and ``weights_fingerprint``)."""
    record = {"finetune": {"lora": lora.record() if lora is not None else None, "freeze": freeze}}
    if base_source is not None:
        from pystronghold.models.hf import weights_fingerprint

        record["base"] = {"source": base_source, "fingerprint": weights_fingerprint(base_source)}
    return record


def _options_text(finetune: dict) -> str:
    lora, freeze = finetune.get("lora"), finetune.get("freeze")
    if lora:
        targets = ",".join(lora["targets"]) if lora.get("targets") else "(PEFT's default)"
        return (f"--lora-rank {lora['rank']} --lora-alpha {lora['alpha']:g} --lora-targets {targets} "
                f"--lora-dropout {lora['dropout']:g}")
    return f"--freeze {freeze!r}" if freeze is not None else "neither --lora-rank nor --freeze"


def check_checkpoint_record(manifest: dict, mine: dict, path) -> None:
    """CheckpointError (one line) unless checkpoint ``path`` (its ``manifest``) was made with the
    fine-tune options of this run (``mine``: its ``checkpoint_record``) and, when it left the frozen
    parameters to a base directory, that directory still holds the weights it was trained from.
    A manifest without these entries predates them: a full fine-tune."""
    from pystronghold.train.checkpoint_dir import CheckpointError

    saved = manifest.get("finetune") or {"lora": None, "freeze": None}
    if saved != mine["finetune"]:
        raise CheckpointError(f"checkpoint {path} was trained with {_options_text(saved)}, this run with "
                              f"{_options_text(mine['finetune'])}; resume with the options it was made with")
    check_base(manifest, path, "resume")


def check_base(manifest: dict, path, use: str) -> None:
    """CheckpointError (one line, saying what ``use`` needs) when checkpoint ``path`` left its
    frozen parameters to a base directory whose config or safetensors files have changed since."""
    base = manifest.get("base")
    if base is None:
        return
    from pystronghold.models.hf import weights_fingerprint
    from pystronghold.train.checkpoint_dir import CheckpointError

    now = weights_fingerprint(base["source"])
    changed = sorted(name for name in {**base["fingerprint"], **now} if base["fingerprint"].get(name) != now.get(name))
    if changed:
        raise CheckpointError(f"checkpoint {path} holds only the trained parameters; the frozen ones come from "
                              f"{base['source']}, which has changed since ({', '.join(changed[:3])}"
                              f"{' and more' if len(changed) > 3 else ''} differ); {use} with the base it was "
                              "trained from")
