"""From a ``Layout`` to the process groups the runtime trains with.

``replicate`` and ``split`` map onto ``pystronghold.parallel.init_parallel(tp, dp)``; the model must
then be built with the TP group (``GPT(config, tp_group=groups.tp_group)``), since a layer's shards
are made when it is built. ``stage``/``pipeline`` need the pipeline runtime (issue 16), which is
not part of this branch: a layout with more than one stage is refused with that reason.
"""

from __future__ import annotations

from pystronghold.parallel.groups import ParallelGroups, init_parallel
from pystronghold.strategy.layout import Layout

__all__ = ["init_layout"]


def init_layout(layout: Layout, *, heads: int | None = None, backend: str | None = None,
                timeout_s: float = 600.0) -> ParallelGroups:
    """The TP x DP groups of ``layout`` (initialising torch.distributed as ``init_parallel`` does).
    ValueError for a layout the runtime cannot run yet (several stages) or that does not fit the
    world (``init_parallel``'s checks, on every rank)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"init_layout: expected a Layout, got {type(layout).__name__}")
    if layout.pp_size > 1:
        raise ValueError(f"init_layout: the layout has {layout.pp_size} stage() scopes; running stages "
                         "needs the pipeline runtime (issue 16), not merged in this build")
    return init_parallel(tp_size=layout.stages[0].tp_size, dp_size=layout.dp_size, heads=heads,
                         backend=backend, timeout_s=timeout_s)
