"""LayerDrop-style stochastic depth for the window runtime (Fan et al. 2019).

At a step's first training forward each streamed block is skipped with probability p, drawn from
the engine's own seeded generator. A skipped block is the identity for every micro-batch of the
step, neither loaded nor updated (its own step count stays, as AdamW leaves a parameter without
``.grad``); the plan is rebuilt over the blocks that run, cached per set. At evaluation every
block runs, without rescaling.
"""

from __future__ import annotations

import torch

__all__ = ["LayerDrop"]


class LayerDrop:
    """Which streamed blocks run this step."""

    def __init__(self, n_blocks: int, p: float, seed: int) -> None:
        self.n_blocks, self.p = n_blocks, float(p)
        self._generator = torch.Generator().manual_seed(seed)
        self._active: list[int] | None = None  # None: not drawn for this step (or p == 0)

    @property
    def enabled(self) -> bool:
        return self.p > 0 and self.n_blocks > 0

    def draw_if_new_step(self) -> None:
        """Draw this step's blocks unless already drawn. If every draw says skip, the block with the
        highest draw runs (a step always runs at least one block)."""
        if self._active is not None or not self.enabled:
            return
        u = torch.rand(self.n_blocks, generator=self._generator)
        keep = [b for b in range(self.n_blocks) if u[b] >= self.p]
        self._active = keep or [int(u.argmax())]

    @property
    def active(self) -> list[int] | None:
        """The blocks running this step in order; None when every block runs (nothing drawn)."""
        if self._active is None or len(self._active) == self.n_blocks:
            return None
        return self._active

    def dropped(self, block: int) -> bool:
        """Whether ``block`` is skipped this step."""
        return self._active is not None and block not in self._active

    def end_step(self) -> None:
        """The next training forward draws again."""
        self._active = None

    def state_dict(self) -> dict:
        """The generator's state (what the next steps will draw): checkpoints keep it, so a resumed
        run skips the blocks the uninterrupted run would have skipped."""
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the draws of ``state_dict()``'s run (between steps only)."""
        if self._active is not None:
            raise RuntimeError("LayerDrop.load_state_dict during a step (its blocks are already drawn)")
        self._generator.set_state(state["generator"])
