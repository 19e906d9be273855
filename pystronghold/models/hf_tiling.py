"""The position-wise MLPs of a Hugging Face model's blocks, run over tiles of the sequence.

``tile_mlps(model, tile_tokens)`` finds each block's MLP (the child named ``mlp``, ``feed_forward``
or ``ffn``) and, when it is a dense position-wise module, one tensor in and one out, replaces its
instance ``forward`` with one that runs the original over tiles of ``tile_tokens`` positions
(``nn.tiled``): its (B, T, F) intermediate never exists whole, forward or backward. Names,
``state_dict`` keys and adapters (PEFT wraps the MLP's linear layers, which the original forward
reads at each call) are unchanged. A mixture of experts (a child named ``experts`` or ``router``)
is left alone: its router's outputs leave the block by hooks and feed the load-balancing loss of
all tokens at once. So is an MLP that takes more than one argument (BLOOM's adds the residual
itself). Each one left alone is said in a debug line.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from pystronghold.models.hf import block_stack
from pystronghold.nn.tiled import tiled

__all__ = ["tile_mlps", "MLP_NAMES"]

log = logging.getLogger(__name__)

MLP_NAMES = ("mlp", "feed_forward", "ffn")
"""The names a block's MLP goes by in transformers, tried in this order."""

_ROUTED = ("experts", "router")
"""Children that make an MLP a mixture of experts."""


class _TiledForward:
    """An MLP's instance ``forward``: its own forward over tiles of ``tile`` positions when called
    with one (B, T, C) tensor, else its own forward unchanged."""

    def __init__(self, module: nn.Module, tile: int) -> None:
        self.module, self.tile = module, tile
        self.replaced = module.__dict__.get("forward")  # an instance forward set before, put back by untiling
        self.original = module.forward  # bound: PEFT's layers inside are read at each call

    def __call__(self, *args, **kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
            return self.original(*args, **kwargs)
        return tiled(self.original, args[0], list(self.module.parameters()), self.tile)


def _why_untiled(mlp: nn.Module) -> str | None:
    """Why ``mlp`` cannot run over tiles, or None when it can."""
    routed = [name for name, _ in mlp.named_children() if name in _ROUTED]
    if routed:
        return f"a mixture of experts (it has {', '.join(routed)})"
    forward = mlp.forward.original if isinstance(mlp.forward, _TiledForward) else mlp.forward
    arguments = inspect.signature(forward).parameters.values()
    positional = [a for a in arguments if a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)]
    required = [a.name for a in arguments if a.default is a.empty and a.kind not in (a.VAR_POSITIONAL, a.VAR_KEYWORD)]
    if not positional or len(required) > 1:
        return f"its forward takes {', '.join(required) or 'no positional argument'}, not one tensor"
    return None


def tile_mlps(model: nn.Module, tile_tokens: int) -> int:
    """Run the MLP of each block of ``model``'s block stack (``models.hf.block_stack``) over tiles
    of ``tile_tokens`` positions of every sample; 0 takes the tiling off again. Returns how many
    MLPs run over tiles (0 for a family whose blocks have none that can)."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 0:
        raise ValueError(f"tile_mlps: tile_tokens must be an int >= 0, got {tile_tokens!r}")
    _, blocks = block_stack(model)
    tiled_count = 0
    left: dict[str, list[int]] = {}  # why -> the blocks left untiled for it
    for index, block in enumerate(blocks):
        name = next((n for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
        if name is None:
            left.setdefault(f"{type(block).__name__} has no MLP child named {' or '.join(MLP_NAMES)}", []).append(index)
            continue
        mlp = getattr(block, name)
        why = _why_untiled(mlp)
        if why is not None:
            left.setdefault(f"{name} ({type(mlp).__name__}) is {why}" if why.startswith("a ")
                            else f"{name} ({type(mlp).__name__}): {why}", []).append(index)
            continue
        patched = mlp.__dict__.get("forward")
        if isinstance(patched, _TiledForward):
            if tile_tokens:
                patched.tile = tile_tokens
            elif patched.replaced is not None:
                mlp.forward = patched.replaced
            else:
                del mlp.forward  # the class's forward again
        elif tile_tokens:
            mlp.forward = _TiledForward(mlp, tile_tokens)
        tiled_count += bool(tile_tokens)
    for why, indices in left.items():
        log.debug("MLP of %d block(s) left untiled: %s", len(indices), why)
    return tiled_count
