"""Blocks must be pure for recompute: the checks that keep a recomputed block equal to its forward.

Backward reruns each block's forward; tensor arguments are saved, non-tensor ones only
referenced, so mutating one would silently recompute something else. ``disable_hf_cache`` gives
Hugging Face training forwards ``use_cache=False``; ``refuse_mutable_arguments`` refuses a
``Cache`` argument and ``fingerprint`` raises when another non-tensor argument changes between
forward and recompute; ``output_checksums`` (strict mode) compares the recomputed output exactly.
"""

from __future__ import annotations

import enum
import inspect
import logging

import torch
from torch.utils import _pytree as pytree

__all__ = ["disable_hf_cache", "fingerprint", "is_mutable_cache", "argument_name", "output_checksums"]

log = logging.getLogger(__name__)

_MAX_DEPTH = 4
"""Attribute levels a fingerprint follows into a non-tensor argument."""
_MAX_NODES = 4096
"""Values a fingerprint visits at most per argument; beyond that the rest is compared by identity."""
_ATOMS = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device,
          torch.Size, type(Ellipsis), slice, range)


def disable_hf_cache(model: torch.nn.Module):
    """Make ``model``'s training forwards (grad enabled) run with ``use_cache=False``.

    Applies to models with a ``config.use_cache`` attribute (Hugging Face) whose ``forward`` accepts
    ``use_cache``; an explicit ``use_cache=`` from the caller is left alone (the block check then
    refuses the cache). Returns the hook handle, or None when the model has no such option.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return None
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "use_cache" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    log.info("wrap: %s has use_cache=True; training forwards run with use_cache=False (as Hugging Face "
             "gradient checkpointing does): a recomputed block must not append to a KV cache twice",
             type(model).__name__)

    def no_cache_in_training(module, args, kwargs):
        if torch.is_grad_enabled() and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return args, kwargs

    return model.register_forward_pre_hook(no_cache_in_training, with_kwargs=True)


def is_mutable_cache(value) -> bool:
    """True for a Hugging Face ``transformers`` Cache object (a KV cache each block appends to)."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
               for cls in type(value).__mro__)


def fingerprint(value):
    """A comparable snapshot of a non-tensor value's state: equal before and after a call iff the
    call did not visibly change it (rebinding attributes, growing lists, in-place tensor writes)."""
    budget = [_MAX_NODES]

    def visit(v, depth):
        budget[0] -= 1
        if isinstance(v, (float, complex)) and v != v:
            return "nan"  # NOTE: NaN != NaN would read as a change
        if isinstance(v, _ATOMS):
            return v
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v), tuple(v.shape), v._version)
        if budget[0] <= 0 or depth >= _MAX_DEPTH or isinstance(v, (torch.nn.Module, type)) or callable(v):
            return ("id", id(v))
        if isinstance(v, (list, tuple)):
            return (type(v), id(v), tuple(visit(x, depth + 1) for x in v))
        if isinstance(v, dict):
            return (type(v), id(v), tuple((k, visit(x, depth + 1)) for k, x in v.items()))
        if isinstance(v, (set, frozenset)):
            return (type(v), id(v), len(v), frozenset(x for x in v if isinstance(x, _ATOMS)))
        state = getattr(v, "__dict__", None)
        slots = [s for cls in type(v).__mro__ for s in getattr(cls, "__slots__", ()) if hasattr(v, s)]
        items = list(state.items()) if isinstance(state, dict) else []
        items += [(s, getattr(v, s)) for s in slots if s != "__dict__"]
        return (type(v), id(v), tuple((k, visit(x, depth + 1)) for k, x in items))

    return visit(value, 0)


def argument_name(spec, index: int) -> str:
    """The name of flat argument ``index`` of a block call flattened as ``(args, kwargs)`` with ``spec``,
    e.g. ``args[1]`` or ``kwargs['past_key_values']``."""
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten([None] * spec.num_leaves, spec))
    key = pytree.keystr(paths[index][0])
    return ("args" + key[3:]) if key.startswith("[0]") else ("kwargs" + key[3:])


def output_checksums(tensors) -> list[tuple]:
    """An exact checksum of each tensor: (shape, dtype, position-weighted int64 sum of its bits).

    Any change of any bit changes the sum except for collisions that need many coordinated flips;
    used by strict mode to prove a recomputed block output equals its forward's.
    """
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        bits = flat.view(ints).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 1_000_003 + 1
        out.append((tuple(t.shape), t.dtype, int((bits * weights).sum())))
    return out
