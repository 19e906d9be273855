"""The inputs of an engine call, moved to the engine's device (as Accelerate's prepared models do).

``engine(x, y)`` accepts host tensors when the engine computes on a GPU: every tensor among the
positional and keyword arguments, also inside lists, tuples, named tuples and dicts (walked with
``torch.utils._pytree``), is copied to the engine's device; from pinned host memory the copy is
non-blocking. A tensor already there is passed as it is. A tensor on any other device (another
GPU, or a GPU tensor given to a CPU engine) is refused with a ``ValueError`` naming the argument:
copying between devices behind the caller's back would hide a mistake in the caller's placement.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

__all__ = ["move_inputs", "on_device", "forward_signature"]


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """True when ``tensor`` lives on ``device`` (a device without an index matches any index)."""
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """The signature of ``model.forward`` (names the arguments in errors); None when it has none."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _argument_name(path, signature: inspect.Signature | None) -> str:
    """``'x'``, ``'batch[0]'`` or ``"kw['ids']"`` for the pytree ``path`` of a leaf of (args, kwargs)."""
    rest = keystr(path[2:])
    if path[0].idx == 1:  # a keyword argument
        return f"{path[1].key}{rest}"
    index = path[1].idx
    params = list(signature.parameters.values()) if signature is not None else []
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return f"{p.name}[{index - i}]{rest}" if index >= i else f"args[{index}]{rest}"
        if p.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
        if i == index:
            return f"{p.name}{rest}"
    return f"args[{index}]{rest}"


def move_inputs(args: tuple, kwargs: dict, device: torch.device | str,
                signature: inspect.Signature | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every host tensor copied to ``device`` (non-blocking when pinned).

    ``signature`` (of the model's ``forward``) names positional arguments in errors. Raises
    ``ValueError`` for a tensor on a device that is neither the host nor ``device``.
    """
    target = torch.device(device)
    leaves, spec = tree_flatten_with_path((args, kwargs))
    if not any(isinstance(v, torch.Tensor) and not on_device(v, target) for _, v in leaves):
        return args, kwargs  # nothing to move (the CPU backend, or inputs already on the device)
    out = []
    for path, value in leaves:
        if isinstance(value, torch.Tensor) and not on_device(value, target):
            if value.device.type != "cpu":
                raise ValueError(f"engine(...): argument {_argument_name(path, signature)!r} is on "
                                 f"{value.device} but the engine runs on {target}; move it to {target} "
                                 "or to the host")
            value = value.to(target, non_blocking=value.is_pinned())
        out.append(value)
    return tree_unflatten(out, spec)
