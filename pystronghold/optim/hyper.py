"""AdamW's settings: ``AdamW`` (what the user passes to ``wrap``) and ``AdamWHyper`` (one update's).

``AdamW`` is the spec: initial values and which parameters decay (``decay_groups``). Its values
become torch param groups (``engine.optimizer.param_groups``, which LR schedulers edit); at every
update each group's current values, the step count and the gradient scale are frozen into one
``AdamWHyper``, and that object travels unchanged to the point where it is unpacked into the native
call (``pystronghold.optim.functional``) or into torch's AdamW (``DeviceAdamW``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AdamW", "AdamWHyper", "decay_groups"]


@dataclass(kw_only=True, slots=True)
class AdamW:
    """AdamW hyper-parameters (decoupled weight decay, Loshchilov & Hutter), as torch.optim.AdamW."""

    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment."""
    eps: float = 1e-8
    """Added to the denominator."""
    weight_decay: float = 0.01
    """Decoupled weight decay (of the parameters that ``decay`` selects)."""
    decay: str = "all"
    """Which parameters decay: "all" (one param group, as ``torch.optim.AdamW(model.parameters())``)
    or "matrices": parameters of >= 2 dimensions (weight matrices and embeddings) in group 0 with
    ``weight_decay``, the rest (biases, norm gains) in group 1 with weight_decay 0, as nanoGPT and
    GPT-3 train. Each group's lr etc. can be changed (by schedulers too)."""
    bitwise_torch: bool = False
    """Update blocks with torch's CPU square root (MKL vmsSqrt) so they are bit-identical to CPU
    ``torch.optim.AdamW``; about 4x slower host updates. The default, a correctly rounded sqrt, differs
    from CPU torch by a few ulp on some elements (docs/DESIGN.md, "Fused CPU Adam")."""

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"AdamW.lr must be >= 0, got {self.lr!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"AdamW.betas must be two values in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise ValueError(f"AdamW.eps must be > 0, got {self.eps!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"AdamW.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.decay not in ("all", "matrices"):
            raise ValueError(f"AdamW.decay must be 'all' or 'matrices', got {self.decay!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWHyper:
    """Everything one Adam/AdamW update needs besides the tensors, frozen.

    Validated on construction (ValueError or TypeError naming the field), so a bad value fails where
    it is made, not inside a worker thread. Defaults are ``torch.optim.AdamW``'s.
    """

    step: int
    """1-based step count after incrementing (torch's ``state['step']`` after the update): the
    bias corrections are ``1 - beta1**step`` and ``1 - beta2**step``."""
    lr: float = 1e-3
    """Learning rate (per unit of normalised gradient)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates (beta1, beta2) of the first and second moment, each in [0, 1)."""
    eps: float = 1e-8
    """Added to the bias-corrected ``sqrt(exp_avg_sq)``."""
    weight_decay: float = 1e-2
    """Decoupled (``param *= 1 - lr*wd``) when ``adamw``, else L2 (``grad += wd*param``)."""
    adamw: bool = True
    """True: ``torch.optim.AdamW`` semantics; False: ``torch.optim.Adam``."""
    grad_scale: float = 1.0
    """Factor applied to the gradient in the same pass: 1/loss_scale times the clip coefficient."""

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int):
            raise TypeError(f"AdamWHyper.step must be an int, got {type(self.step).__name__}")
        if self.step < 1:
            raise ValueError(f"AdamWHyper.step must be >= 1 (the count after incrementing), got {self.step}")
        for name in ("lr", "eps", "weight_decay", "grad_scale"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2:
            raise ValueError(f"AdamWHyper.betas must be two values (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", (_number("betas[0]", betas[0]), _number("betas[1]", betas[1])))
        if not self.lr >= 0:
            raise ValueError(f"AdamWHyper.lr must be >= 0, got {self.lr}")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"AdamWHyper.betas[{i}] must be in [0, 1), got {beta}")
        if not self.eps >= 0:
            raise ValueError(f"AdamWHyper.eps must be >= 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"AdamWHyper.weight_decay must be >= 0, got {self.weight_decay}")
        if not math.isfinite(self.grad_scale):
            raise ValueError(f"AdamWHyper.grad_scale must be finite, got {self.grad_scale}")
        object.__setattr__(self, "adamw", bool(self.adamw))

    @classmethod
    def from_group(cls, group: dict, *, step: int, grad_scale: float = 1.0, adamw: bool = True) -> AdamWHyper:
        """The hyper-parameters of a torch param group (``lr`` may be a 1-element tensor) at ``step``."""
        return cls(step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                   weight_decay=group["weight_decay"], adamw=adamw, grad_scale=grad_scale)


def _number(name: str, value) -> float:
    """``value`` as a Python float (a 1-element tensor included); TypeError naming the field otherwise."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"AdamWHyper.{name} must be a number or a 1-element tensor, got shape "
                             f"{tuple(value.shape)}")
        return float(value.item())
    try:
        return float(value)  # ints, numpy scalars and the like
    except (TypeError, ValueError):
        raise TypeError(f"AdamWHyper.{name} must be a number, got {type(value).__name__}") from None


def decay_groups(params, spec: AdamW, shapes: dict[int, torch.Size] | None = None) -> list[dict]:
    """``params`` split into torch param groups as ``spec.decay`` says (see ``AdamW.decay``);
    ``shapes``: the real shape by id(parameter) where the parameter object is a placeholder."""
    params = list(params)
    if spec.decay == "all":
        return [{"params": params}]
    shapes = shapes or {}
    matrices = [len(shapes.get(id(p), p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrices) if m]},
              {"params": [p for p, m in zip(params, matrices) if not m], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
