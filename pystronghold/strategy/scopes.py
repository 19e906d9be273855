"""Whale's strategy scopes: ``replicate``, ``split``, ``stage``, ``pipeline`` (Jia et al., ATC'22).

A scope is a context manager: modules built while it is open are annotated with the stack of
open scopes (``annotate(*modules)`` does it for existing ones); ``strategy.layout.layout_of``
turns the annotations into a ``Layout``. Nesting is restricted to what the TP x PP x DP grid runs:
``replicate(n)`` outermost only; ``pipeline(m)`` not inside stage, split or pipeline; ``stage()``
not inside split or stage; ``split(n)`` not inside split. A violation raises one ValueError naming
the scope. Unannotated modules take ``set_default_strategy`` (initially ``replicate(None)``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass


from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

__all__ = ["Scope", "replicate", "split", "stage", "pipeline", "annotate", "strategy_of",
           "set_default_strategy", "default_strategy", "open_scopes"]

_ids = itertools.count()
_state = threading.local()
_annotations: "weakref.WeakKeyDictionary[nn.Module, tuple[Scope, ...]]" = weakref.WeakKeyDictionary()
_default: tuple["Scope", ...] = ()


@dataclass(frozen=True, slots=True)
class Scope:
    """One opened strategy scope (immutable; the annotation of a module is a tuple of them)."""

    kind: str
    """"replicate", "split", "stage" or "pipeline"."""
    device_count: int | None = None
    """replicate: replicas (None: whatever is left); split: TP degree; else None."""
    num_micro_batch: int | None = None
    """pipeline: micro-batches per step; else None."""
    uid: int = -1
    """Opening order (stages are numbered by it)."""

    def __str__(self) -> str:
        if self.kind == "pipeline":
            return f"pipeline(num_micro_batch={self.num_micro_batch})"
        if self.kind == "stage":
            return "stage()"
        return f"{self.kind}({self.device_count})"


def open_scopes() -> tuple[Scope, ...]:
    """The scopes open on this thread, outermost first."""
    return tuple(getattr(_state, "stack", ()))


def _check_nesting(new: Scope, outer: tuple[Scope, ...]) -> None:
    kinds = [s.kind for s in outer]
    where = " inside ".join(str(s) for s in (new, *reversed(outer)))
    if new.kind == "replicate" and outer:
        raise ValueError(f"{where}: replicate must be the outermost scope (pystronghold's data "
                         "parallelism spans the whole model; per-stage replication is not supported)")
    if new.kind == "pipeline" and {"pipeline", "stage", "split"} & set(kinds):
        raise ValueError(f"{where}: a pipeline may only be inside replicate")
    if new.kind == "stage" and {"stage", "split"} & set(kinds):
        raise ValueError(f"{where}: a stage may not be inside another stage or a split "
                         "(open the stage first, then split inside it)")
    if new.kind == "split" and "split" in kinds:
        raise ValueError(f"{where}: splits do not nest (one TP degree per module)")


def _positive(kind: str, name: str, value, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{kind}: {name} must be a positive int{' or None' if allow_none else ''}, "
                         f"got {value!r}")


def _tag(module: nn.Module, stack: tuple[Scope, ...]) -> None:
    # NOTE: the first annotation wins: a block built inside stage() and assigned to a parent
    # later, under other scopes, keeps its stage.
    if module not in _annotations:
        _annotations[module] = stack


def _on_parameter(module, name, param):
    stack = open_scopes()
    if stack:
        _tag(module, stack)


def _on_module(module, name, child):
    stack = open_scopes()
    if stack and child is not None:
        _tag(child, stack)


@contextlib.contextmanager
def _open(scope: Scope):
    outer = open_scopes()
    _check_nesting(scope, outer)
    stack = (*outer, scope)
    handles = []
    if not outer:  # the hooks are global: install them once, for the outermost scope
        handles = [register_module_parameter_registration_hook(_on_parameter),
                   register_module_module_registration_hook(_on_module)]
    _state.stack = stack
    try:
        yield scope
    finally:
        _state.stack = outer
        for h in handles:
            h.remove()


def replicate(device_count: int | None = None):
    """Data parallelism: the model (or everything inside) runs as ``device_count`` replicas, each
    on its own slice of the batch (None: as many replicas as the devices left by the other scopes)."""
    _positive("replicate", "device_count", device_count, allow_none=True)
    return _open(Scope("replicate", device_count=device_count, uid=next(_ids)))


def split(device_count: int):
    """Tensor parallelism: the modules inside are sharded over ``device_count`` devices (the
    model's TP layers, ``pystronghold.parallel.layers``)."""
    _positive("split", "device_count", device_count, allow_none=False)
    return _open(Scope("split", device_count=device_count, uid=next(_ids)))


def stage():
    """One pipeline stage: the modules inside run on their own devices, after the previous stage."""
    return _open(Scope("stage", uid=next(_ids)))


def pipeline(num_micro_batch: int):
    """The stages inside form a pipeline fed with ``num_micro_batch`` micro-batches per step."""
    _positive("pipeline", "num_micro_batch", num_micro_batch, allow_none=False)
    return _open(Scope("pipeline", num_micro_batch=num_micro_batch, uid=next(_ids)))


def annotate(*modules: nn.Module) -> None:
    """Annotate existing ``modules`` (and their submodules that carry no annotation yet) with the
    scopes open now. TypeError for a non-module; ValueError outside any scope."""
    stack = open_scopes()
    if not stack:
        raise ValueError("annotate() must be called inside a replicate/split/stage/pipeline scope")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"annotate: expected nn.Module, got {type(m).__name__}")
        for sub in m.modules():
            _tag(sub, stack)


def strategy_of(module: nn.Module) -> tuple[Scope, ...]:
    """The scopes ``module`` was annotated with, outermost first (() if none)."""
    return _annotations.get(module, ())


def set_default_strategy(scope_factory=None) -> None:
    """The strategy of modules no scope annotates: ``set_default_strategy(lambda: replicate(4))``
    or ``set_default_strategy(None)`` for Whale's default, ``replicate(None)``. Only a replicate
    can be a default (a default stage or split would put every unannotated module in one piece)."""
    global _default
    if scope_factory is None:
        _default = ()
        return
    with scope_factory() as scope:
        pass
    if not isinstance(scope, Scope) or scope.kind != "replicate":
        raise ValueError(f"set_default_strategy: only replicate(n) can be the default, got {scope}")
    _default = (scope,)


def default_strategy() -> tuple[Scope, ...]:
    """The default strategy's scopes (() means ``replicate(None)``)."""
    return _default


