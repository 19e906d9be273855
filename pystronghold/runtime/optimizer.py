"""The optimizer the user sees, and the device-side optimizer of head and tail.

``AdamW`` is the spec passed to ``wrap``. ``engine.optimizer`` is a ``WindowOptimizer``: a real
``torch.optim.Optimizer`` whose param groups carry lr, betas, eps and weight_decay, so LR
schedulers and manual ``lr`` edits work; the engine reads the groups at every update. With
``AdamW(decay="matrices")`` there are two groups, as nanoGPT builds them: parameters of two or more
dimensions (weight matrices and embeddings) decay, the others (biases, norm gains) have
weight_decay 0. Its ``step``
and ``zero_grad`` run the engine's. Block parameters are updated by the fused CPU Adam on the host
store; head and tail parameters (on the device) by ``torch.optim.AdamW`` with the same settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pystronghold.runtime.grad_norms import param_grad_norms

__all__ = ["AdamW", "WindowOptimizer", "DeviceAdamW"]


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


class WindowOptimizer(torch.optim.Optimizer):
    """``engine.optimizer``: every model parameter in the param groups of ``decay_groups``;
    step/zero_grad run the engine's."""

    def __init__(self, engine, params, spec: AdamW, shapes: dict[int, torch.Size] | None = None) -> None:
        """``shapes``: real shapes of placeholder parameters (offloaded blocks), by id."""
        defaults = dict(lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
        super().__init__(decay_groups(params, spec, shapes), defaults)
        self._engine = engine

    def group_of(self) -> dict[int, int]:
        """Index of each parameter's param group, by id(parameter)."""
        return {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}

    def hyper(self) -> list[dict]:
        """Current (lr, betas, eps, weight_decay) of each param group, as dicts in group order."""
        return [dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])
                for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine._step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine._zero_grad()

    def state_dict(self) -> dict:
        """torch.optim.AdamW's format for every parameter (block or head/tail), by index in
        ``model.parameters()``: ``step``, ``exp_avg``, ``exp_avg_sq`` (the live tensors, as torch's),
        plus ``param_groups``."""
        from pystronghold.runtime.state_dict import optimizer_state_dict

        return optimizer_state_dict(self._engine)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of ``state_dict()`` or of ``torch.optim.AdamW(model.parameters())``."""
        from pystronghold.runtime.state_dict import load_optimizer_state_dict

        load_optimizer_state_dict(self._engine, state_dict)


class DeviceAdamW:
    """AdamW of head and tail, on the device, over fp32 masters.

    In fp32 the masters are the parameters themselves; in bf16/fp16 they are fp32 copies and the
    parameters are rewritten in compute precision after each update.
    """

    def __init__(self, params: list[torch.nn.Parameter], spec: AdamW, masters: list[torch.Tensor],
                 groups: list[int] | None = None, fused: bool = False) -> None:
        """``masters``: fp32 values of ``params`` taken before they were cast to compute precision;
        ``groups``: the engine's param group of each parameter (default all in group 0); ``fused``:
        torch's fused AdamW kernel (CUDA); otherwise its single-tensor loop."""
        self.params = params
        self.fused = fused
        half = any(p.dtype != torch.float32 for p in params)
        self.masters = [m.detach().clone().requires_grad_(True) for m in masters] if half else params
        groups = groups if groups is not None else [0] * len(params)
        self._group_ids = sorted(set(groups))  # engine group of each torch group
        torch_groups = [{"params": [m for m, g in zip(self.masters, groups) if g == gid]}
                        for gid in self._group_ids]
        self._opt = torch.optim.AdamW(torch_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                      weight_decay=spec.weight_decay, foreach=False,
                                      fused=True if fused else None) if params else None

    def _step_tensor(self, index: int, value: float) -> torch.Tensor:
        # NOTE: where torch keeps it: on the parameter's device for the fused kernel, else on the CPU
        device = self.masters[index].device if self.fused else "cpu"
        return torch.tensor(float(value), dtype=torch.float32, device=device)

    @torch.no_grad()
    def write_moment(self, index: int, key: str, value: torch.Tensor) -> None:
        """Overwrite moment ``key`` ("exp_avg"/"exp_avg_sq") of parameter ``index``; a parameter
        without state gets zero moments and step 0 first (AdamW's state before its first update)."""
        m = self.masters[index]
        st = self._opt.state.get(m)
        if not st:
            st = self._opt.state[m] = {"step": self._step_tensor(index, 0.0), "exp_avg": torch.zeros_like(m),
                                       "exp_avg_sq": torch.zeros_like(m)}
        st[key].copy_(value)

    @torch.no_grad()
    def set_steps(self, steps: int) -> None:
        """Set the step count of every parameter that has AdamW state to ``steps``."""
        for i, m in enumerate(self.masters):
            st = self._opt.state.get(m) if self._opt is not None else None
            if st:
                st["step"] = self._step_tensor(i, steps)

    def state_of(self, index: int) -> dict:
        """torch AdamW state of parameter ``index`` (``step``, ``exp_avg``, ``exp_avg_sq``; {} before
        its first update). The live tensors: copy them to keep them."""
        return dict(self._opt.state.get(self.masters[index], {})) if self._opt is not None else {}

    @torch.no_grad()
    def load_state(self, index: int, state: dict) -> None:
        """Replace parameter ``index``'s AdamW state (``{}``: none, as before the first update)."""
        m = self.masters[index]
        if not state:
            if self._opt is not None:
                self._opt.state.pop(m, None)
            return
        self._opt.state[m] = {"step": self._step_tensor(index, float(state["step"])),
                              **{k: state[k].detach().to(device=m.device, dtype=torch.float32, copy=True)
                                 for k in ("exp_avg", "exp_avg_sq")}}

    def grad_norms(self, grad_scale: float) -> dict[int, torch.Tensor]:
        """fp32 L2 norm of each parameter's gradient x ``grad_scale``, keyed by id(parameter)."""
        with_grad = [p for p in self.params if p.grad is not None]
        # taken where the gradients are; one copy to the host, where global_grad_norm combines them
        norms = param_grad_norms([p.grad for p in with_grad], grad_scale).cpu()
        return {id(p): n for p, n in zip(with_grad, norms)}

    @torch.no_grad()
    def step(self, hyper: list[dict], grad_scale: float) -> None:
        """One AdamW step with gradients multiplied by ``grad_scale`` (clip coefficient / loss scale);
        ``hyper``: the engine's param groups' settings (``WindowOptimizer.hyper()``)."""
        if self._opt is None:
            return
        for group, gid in zip(self._opt.param_groups, self._group_ids):
            h = hyper[gid]
            group.update(lr=h["lr"], betas=h["betas"], eps=h["eps"], weight_decay=h["weight_decay"])
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            if m is not p:
                m.grad = p.grad.float()
            if grad_scale != 1.0:
                m.grad.mul_(grad_scale)
        self._opt.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None
