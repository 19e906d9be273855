"""Find a model's stack of transformer blocks, so ``wrap(model)`` works without ``blocks=``.

The stack is the one ``nn.ModuleList`` named in ``STACK_NAMES`` at the top of the model or up to
two levels down (``blocks``, ``transformer.h``, ``model.layers``, ``gpt_neox.layers``, ...); a
wrapper with ``get_base_model()`` (PEFT) is looked through and the full path returned. A
ModuleList inside another is never a candidate. None, or more than one, raises ValueError asking
for ``blocks=``.
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["find_blocks", "STACK_NAMES", "MAX_DEPTH"]

log = logging.getLogger(__name__)

STACK_NAMES = ("blocks", "layers", "h", "layer", "block")
"""Attribute names a block stack goes by."""
MAX_DEPTH = 3
"""Deepest dotted path searched: ``blocks`` is depth 1, ``model.decoder.layers`` depth 3."""


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified_name, stack)`` of the one block stack in ``model``.

    Raises ValueError when no non-empty candidate exists or when several do.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks expects an nn.Module, got {type(model).__name__}")
    inner, prefix = _wrapped_model(model)
    candidates = [(prefix + name, stack) for name, stack in _candidates(inner)]
    if not candidates:
        raise ValueError(
            f"no block stack found in {type(model).__name__}: looked for a non-empty nn.ModuleList "
            f"named one of {', '.join(STACK_NAMES)} within {MAX_DEPTH} levels of the model; "
            "pass blocks=<your ModuleList> explicitly")
    if len(candidates) > 1:
        listed = ", ".join(f"{name} ({len(stack)} modules)" for name, stack in candidates)
        raise ValueError(
            f"ambiguous block stack in {type(model).__name__}: found {listed}; "
            "pass blocks=<the ModuleList to window> explicitly")
    name, stack = candidates[0]
    log.info("found the block stack: %s.%s, %d x %s", type(model).__name__, name, len(stack),
             type(stack[0]).__name__)
    return name, stack


def _wrapped_model(model: nn.Module) -> tuple[nn.Module, str]:
    """``(the innermost model, its dotted path + ".")`` through wrappers whose ``get_base_model()``
    returns a module inside them; ``(model, "")`` for a model that wraps nothing."""
    prefix = ""
    while callable(getattr(model, "get_base_model", None)):
        inner = model.get_base_model()
        path = next((name for name, m in model.named_modules() if m is inner and name), None)
        if path is None:  # itself, or not one of its modules: nothing to look through
            break
        model, prefix = inner, f"{prefix}{path}."
    return model, prefix


def _candidates(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    found: list[tuple[str, nn.ModuleList]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, prefix: str, depth: int) -> None:
        for child_name, child in module.named_children():
            path = f"{prefix}{child_name}"
            if isinstance(child, nn.ModuleList):
                if child_name in STACK_NAMES and len(child) > 0 and id(child) not in seen:
                    seen.add(id(child))
                    found.append((path, child))
                continue  # never look inside a ModuleList: its lists are parts of one block
            if depth < MAX_DEPTH:
                visit(child, path + ".", depth + 1)

    visit(model, "", 1)
    return found
