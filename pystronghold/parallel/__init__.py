"""Megatron-style tensor parallelism on torch.distributed (NCCL on GPUs, gloo on CPUs).

- ``groups``: the TP x DP process grid (``init_parallel``) and its validation.
- ``mappings``: the four region functions (copy-to, reduce-from, scatter-to, gather-from).
- ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``, and the
  seeded init that gives every TP size the single-process weights.
- ``data``: the window runtime's collectives: per-block data-parallel gradient averaging, the
  clipping norm over TP shards, the fp16 overflow flag agreed by every rank.
"""

from pystronghold.parallel.groups import (ParallelGroups, group_rank, group_size, init_parallel,
                                          validate_parallel_sizes)
from pystronghold.parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                          VocabParallelEmbedding, gather_tp_param, gather_tp_tensor,
                                          init_normal_, mark_tp_split, tp_slice)
from pystronghold.parallel.mappings import (copy_to_tp_region, gather_from_tp_region,
                                            reduce_from_tp_region, scatter_to_tp_region)

__all__ = [
    "ParallelGroups", "init_parallel", "validate_parallel_sizes", "group_size", "group_rank",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "init_normal_", "gather_tp_param", "gather_tp_tensor", "tp_slice", "mark_tp_split",
]
