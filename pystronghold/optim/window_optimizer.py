"""``engine.optimizer``: the optimizer the user sees when a model is wrapped.

A real ``torch.optim.Optimizer`` whose param groups carry lr, betas, eps and weight_decay, so LR
schedulers and ``lr`` edits work (``AdamW(decay="matrices")``: two groups, as nanoGPT). It updates
nothing itself: ``step``, ``zero_grad`` and the state dict call its ``WindowSteps`` (the engine),
which reads each group's values as one ``AdamWHyper`` per update.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .hyper import AdamW, AdamWHyper, decay_groups

__all__ = ["WindowOptimizer", "WindowSteps"]


class WindowSteps(Protocol):
    """What a ``WindowOptimizer`` runs for its ``step``, ``zero_grad`` and state dict: the engine.

    Its methods are looked up at each call, so a method replaced on the object after the optimizer
    was made (a test wrapping ``run_step``) is the one that runs."""

    def run_step(self) -> None:
        """The optimizer step: every block and head/tail parameter updated from its gradient."""

    def forget_grads(self) -> None:
        """Every gradient dropped."""

    def optimizer_state_dict(self) -> dict:
        """The optimizer state in ``torch.optim.AdamW``'s format."""

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load what ``optimizer_state_dict`` returned (or a ``torch.optim.AdamW``'s state dict)."""


class WindowOptimizer(torch.optim.Optimizer):
    """Every model parameter in the param groups of ``decay_groups``; step/zero_grad/state dict run
    those of its ``WindowSteps``."""

    def __init__(self, params, spec: AdamW, shapes: dict[int, torch.Size] | None = None, *,
                 steps: WindowSteps) -> None:
        """``shapes``: real shapes of placeholder parameters (offloaded blocks), by id; ``steps``:
        what runs the step, the gradient reset and the state dict (the engine)."""
        defaults = dict(lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
        super().__init__(decay_groups(params, spec, shapes), defaults)
        self._steps = steps

    def group_of(self) -> dict[int, int]:
        """Index of each parameter's param group, by id(parameter)."""
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def hyper(self, step: int, grad_scale: float = 1.0) -> list[AdamWHyper]:
        """Each param group's current values as the AdamW update at ``step`` (1-based, after
        incrementing) with gradients multiplied by ``grad_scale`` sees them, in group order."""
        return [AdamWHyper.from_group(g, step=step, grad_scale=grad_scale) for g in self.param_groups]

    def group_settings(self) -> list[dict]:
        """Current (lr, betas, eps, weight_decay) of each param group, as dicts in group order: what
        a checkpoint stores and ``param_groups[i].update`` takes back."""
        return [dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])
                for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._steps.run_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._steps.forget_grads()

    def state_dict(self) -> dict:
        """torch.optim.AdamW's format for every parameter (block or head/tail), by index in
        ``model.parameters()``: ``step``, ``exp_avg``, ``exp_avg_sq`` (the live tensors, as torch's),
        plus ``param_groups``."""
        return self._steps.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of ``state_dict()`` or of ``torch.optim.AdamW(model.parameters())``."""
        self._steps.load_optimizer_state_dict(state_dict)
