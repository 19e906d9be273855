"""The modules a pipeline stage is made of (``pipelining.pipeline`` runs them).

- ``PipelineStageModule`` / ``build_stage``: one stage's part of the model (head? blocks, tail?), the
  module torch's ``PipelineStage`` runs. Any list of blocks works (``whale`` maps its scopes here).
- ``PipelineChunks``: one rank's model chunks under the interleaved schedule, as one model whose
  ``blocks`` the window runtime streams (one engine per rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["PipelineStageModule", "PipelineChunks", "build_stage"]


class PipelineStageModule(nn.Module):
    """One stage: ``head`` (first stage), ``blocks`` (an ``nn.ModuleList``: what the window streams),
    ``tail`` (last stage). ``forward(x)`` = tail(blocks(head(x))), skipping the parts that are None.

    ``first_block`` is the global index of ``blocks[0]`` (for names and logs); ``materialize(i)``,
    when given, builds global block ``i`` of a model made on ``meta`` (``wrap`` calls it through
    ``materialize_block_`` with the local index).
    """

    def __init__(self, head: nn.Module | None, blocks: Sequence[nn.Module], tail: nn.Module | None, *,
                 first_block: int = 0, materialize: Callable[[int], nn.Module] | None = None,
                 materialize_thread_safe: bool = False) -> None:
        super().__init__()
        if not blocks:
            raise ValueError("build_stage: blocks is empty; every pipeline stage needs at least one block")
        self.head = head
        self.blocks = blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList(blocks)
        self.tail = tail
        self.first_block = first_block
        self._materialize = materialize
        self.materialize_block_thread_safe = materialize_thread_safe

    def materialize_block_(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Build local block ``index`` (global ``first_block + index``) with the model's materializer."""
        if self._materialize is None:
            raise ValueError("PipelineStageModule: blocks on meta but no materialize= was given")
        self._materialize(self.first_block + index)
        return self.blocks[index]

    @property
    def block_indices(self) -> list[int]:
        """The global index of each of ``blocks``."""
        return list(range(self.first_block, self.first_block + len(self.blocks)))

    @property
    def chunk_ranges(self) -> list[range]:
        """The local indices of each chunk's blocks in ``blocks``."""
        return [range(len(self.blocks))]

    def model_name(self, name: str) -> str:
        """A parameter's name in the whole model from its stage name with the global block index
        (``blocks.{g}.*``, ``head.*``, ``tail.*``): the same here, where the model's parts carry
        those names (our GPT's); a stage of a model named otherwise maps them."""
        return name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            x = self.head(x)
        for block in self.blocks:
            x = block(x)
        if self.tail is not None:
            x = self.tail(x)
        return x


class PipelineChunks(nn.Module):
    """One rank's model chunks under the interleaved schedule (virtual stages r, r + p, ...), as one
    model for the window runtime: ``blocks`` holds every chunk's blocks in chunk order (one engine
    over all of them: one window, store and host optimizer), ``head`` the first chunk's head (rank
    0), ``tail`` the last chunk's tail (the last rank), under the model's names. torch's schedule
    runs each of ``chunks`` as its own stage; this module's own forward is never called."""

    def __init__(self, chunks: Sequence[PipelineStageModule]) -> None:
        super().__init__()
        if len(chunks) < 2:
            raise ValueError(f"PipelineChunks: give 2 or more model chunks, got {len(chunks)}")
        if any(c.head is not None for c in chunks[1:]) or any(c.tail is not None for c in chunks[:-1]):
            raise ValueError("PipelineChunks: only the first chunk may hold the head and only the last "
                             "the tail (virtual stages 0 and p*v - 1)")
        self.head, self.tail = chunks[0].head, chunks[-1].tail
        self.blocks = nn.ModuleList([b for c in chunks for b in c.blocks])
        # a tuple is no submodule: every parameter is registered once, above, under the model's name
        self._chunks = tuple(chunks)
        self.materialize_block_thread_safe = all(c.materialize_block_thread_safe for c in chunks)
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.blocks))
        self._ranges = [range(a, b) for a, b in zip(starts, starts[1:])]

    @property
    def chunk_ranges(self) -> list[range]:
        """The local indices of each chunk's blocks in ``blocks``."""
        return list(self._ranges)

    @property
    def block_indices(self) -> list[int]:
        """The global index of each of ``blocks``."""
        return [g for c in self._chunks for g in c.block_indices]

    def materialize_block_(self, index: int, device: torch.device | str = "cpu") -> nn.Module:
        """Build local block ``index`` with its chunk's materializer."""
        chunk = next(c for c, r in enumerate(self._ranges) if index in r)
        self._chunks[chunk].materialize_block_(index - self._ranges[chunk].start, device)
        return self.blocks[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PipelineChunks runs through the interleaved schedule, one chunk at a time "
                           "(Pipeline.step); it has no forward of its own")


def build_stage(head: nn.Module | None, blocks: Sequence[nn.Module], tail: nn.Module | None, *,
                first_block: int = 0, materialize: Callable[[int], nn.Module] | None = None,
                materialize_thread_safe: bool = False) -> PipelineStageModule:
    """The public way to make a pipeline stage from a given list of blocks (``Pipeline`` runs it):
    ``head`` on the first stage only, ``tail`` on the last only (None elsewhere). Each block maps
    one activation tensor to one of the same shape."""
    return PipelineStageModule(head, blocks, tail, first_block=first_block, materialize=materialize,
                               materialize_thread_safe=materialize_thread_safe)
