"""A thread's ``torch.autocast`` state, captured where a block's forward runs and entered again
where its code runs a second time, as ``torch.utils.checkpoint`` does.

Autocast is thread-local and lasts only as long as the caller's ``with torch.autocast(...)``. Two
places run block code outside it: the backward recompute (the usual AMP recipe calls backward after
the ``with`` has closed: a recompute without autocast would give the gradients of another function
than the one whose loss was reported) and the relay's micro-batch threads (new threads start with
autocast off).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["AutocastState", "capture", "entered"]

AutocastState = tuple[dict, ...]
"""Keyword arguments of the ``torch.autocast`` contexts that reproduce a state, one per device type."""


def capture(device: torch.device) -> AutocastState:
    """The calling thread's autocast state on the CPU and on ``device``'s type, enabled or not (so
    entering it also turns off an autocast the entering thread happens to be under)."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                      dtype=torch.get_autocast_dtype(kind), cache_enabled=cache)
                 for kind in dict.fromkeys(("cpu", device.type)))


@contextlib.contextmanager
def entered(state: AutocastState):
    """Run the body under ``state`` (``capture``'s); nothing is entered when the calling thread is
    already in it (the common case: no autocast anywhere)."""
    if all(torch.is_autocast_enabled(s["device_type"]) == s["enabled"] and
           (not s["enabled"] or (torch.get_autocast_dtype(s["device_type"]) == s["dtype"] and
                                 torch.is_autocast_cache_enabled() == s["cache_enabled"]))
           for s in state):
        yield
        return
    with contextlib.ExitStack() as stack:
        for kwargs in state:
            stack.enter_context(torch.autocast(**kwargs))
        yield
