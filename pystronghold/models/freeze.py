"""``--freeze REGEX``: every parameter trains but those whose full name the pattern matches (the
option: ``settings.finetune.FinetuneOptions.freeze``)."""

from __future__ import annotations

import re

from torch import nn

from pystronghold.options import ConfigError

__all__ = ["freeze_matching"]


def freeze_matching(model: nn.Module, pattern: str) -> int:
    """Set ``requires_grad=False`` on the parameters of ``model`` whose names ``pattern`` matches
    (``re.search``); returns how many. ConfigError when it matches none or all of them."""
    regex = re.compile(pattern)
    named = list(model.named_parameters())
    matched = [p for name, p in named if regex.search(name)]
    if not matched:
        sample = ", ".join(name for name, _ in named[:3])
        raise ConfigError(f"--freeze {pattern!r} matches no parameter (names look like {sample}, ...)")
    if len(matched) == len(named):
        raise ConfigError(f"--freeze {pattern!r} matches every parameter: nothing would train")
    for p in matched:
        p.requires_grad_(False)
    return len(matched)
