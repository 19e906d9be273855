"""From a ``Layout`` to the process groups the runtime trains with.

``replicate``, ``split`` and ``stage`` map onto ``pystronghold.parallel.init_parallel(tp, dp,
pp=...)`` (``init_layout``); the model must then be built with the TP group
(``GPT(config, tp_group=groups.tp_group)``), since a layer's shards are made when it is built. A
layout with several stages runs on the pipeline runtime (``pystronghold.pipelining.gpt_pipeline_of``
gives it the stages' block ranges, ``Layout.block_ranges``, and the ``pipeline(num_micro_batch)``
scope's micro-batches).
"""

from __future__ import annotations

from pystronghold.parallel.groups import ParallelGroups, init_parallel
from pystronghold.strategy.layout import Layout

__all__ = ["init_layout"]


def init_layout(layout: Layout, *, heads: int | None = None, backend: str | None = None,
                timeout_s: float = 600.0) -> ParallelGroups:
    """The PP x TP x DP groups of ``layout`` (initialising torch.distributed as ``init_parallel``
    does). ValueError for a layout the runtime cannot run (stages of unlike TP degrees) or that
    does not fit the world (``init_parallel``'s checks, on every rank)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"init_layout: expected a Layout, got {type(layout).__name__}")
    degrees = [s.tp_size for s in layout.stages]
    if len(set(degrees)) > 1:
        raise ValueError(f"init_layout: the stage() scopes have split degrees {degrees}; the pipeline "
                         "runtime runs one TP degree in every stage (give each stage the same split(n))")
    return init_parallel(tp_size=degrees[0], dp_size=layout.dp_size, pp=layout.pp_size, heads=heads,
                         backend=backend, timeout_s=timeout_s)
