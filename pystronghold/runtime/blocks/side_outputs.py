"""Tensors that leave a block by a side channel (a forward hook on a submodule: MoE router logits,
attention weights), carried out of its autograd Function so a loss built on them trains the block.

``Watch`` notes, by position, the tensors submodules return during a training forward; those still
held outside after the block are its side outputs, returned as extra Function outputs and given
their gradient edge in place (``attach``). ``Replay`` picks the same positions in the recompute.
Cost: ~70 us per Llama block forward on the dev CPU (every submodule call takes the hook path).
A tensor that is no submodule's output cannot be found again; strict mode names it.
"""

from __future__ import annotations

import gc
import threading
import types
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["Watch", "Replay", "SideOutput", "attach"]


def _tensor_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) is tuple and all(x is None or type(x) is torch.Tensor for x in value):
        return [x for x in value if x is not None]  # NOTE: the common case, without pytree's cost
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _block_state_ids(module: torch.nn.Module) -> set[int]:
    """Ids of the tensors a block keeps itself: parameters, buffers and tensor attributes of its
    modules (a lazily made cache). They are the block's state, not side outputs."""
    ids = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    for m in module.modules():
        ids.update(id(v) for v in vars(m).values() if isinstance(v, torch.Tensor))
    return ids


class _OnThread:
    """A global module forward hook, registered while ``with`` lasts, that sees only the calls of the
    thread that entered (other threads' models are none of the block's business)."""

    def __init__(self) -> None:
        self.calls = 0  # submodule calls seen so far

    def __enter__(self):
        self._thread = threading.get_ident()
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def _hook(self, module, args, output) -> None:
        if threading.get_ident() == self._thread:
            self.note(self.calls, module, output)
            self.calls += 1

    def note(self, call: int, module, output) -> None:
        raise NotImplementedError


class SideOutput:
    """One side output found by a ``Watch``: the tensor, where the recompute finds it again, and
    what it is (for messages)."""

    __slots__ = ("tensor", "position", "shape", "dtype", "source")

    def __init__(self, tensor: torch.Tensor, position: tuple[int, int], module_type: type) -> None:
        self.tensor, self.position = tensor, position
        self.source = f"output {position[1]} of its {module_type.__name__}"
        self.shape, self.dtype = tensor.shape, tensor.dtype


class Watch(_OnThread):
    """``with Watch(block, module, strict): module's forward``, then ``escaped(...)``."""

    def __init__(self, block: int, module: torch.nn.Module, strict: bool) -> None:
        super().__init__()
        self.block, self.module = block, module
        self._seen: dict[int, tuple[weakref.ref, tuple[int, int], type]] = {}  # id -> (ref, position, module type)
        self._made = _MadeInBlock() if strict else None

    def __enter__(self):
        super().__enter__()
        if self._made is not None:
            self._made.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._made is not None:
            self._made.__exit__(*exc)
        super().__exit__(*exc)

    def note(self, call: int, module, output) -> None:
        for j, t in enumerate(_tensor_leaves(output)):
            entry = self._seen.get(id(t))
            if entry is None or entry[0]() is not t:  # first place only; a dead tensor's id may be reused
                self._seen[id(t)] = (weakref.ref(t), (call, j), type(module))

    def escaped(self, inputs, outputs) -> list[SideOutput]:
        """The side outputs of the block call just watched (call after it returned). ``inputs``: the
        tensors the block got; ``outputs``: those it returned. Strict mode raises on a tensor made
        in the block that escapes and is no submodule's output."""
        known = {id(t) for t in inputs if isinstance(t, torch.Tensor)} | {id(t) for t in outputs}
        alive = []
        for ref, position, module_type in self._seen.values():
            t = ref()
            if t is not None and id(t) not in known and (t.is_floating_point() or t.is_complex()):
                alive.append(SideOutput(t, position, module_type))
        self._seen.clear()
        if alive:
            state = _block_state_ids(self.module)
            alive = [s for s in alive if id(s.tensor) not in state]
        if self._made is not None:
            self._made.check(self.block, known | {id(s.tensor) for s in alive}, inputs, outputs, alive)
        return alive


class Replay(_OnThread):
    """``with Replay(sides): the recompute``, then ``tensors(block)``: the recomputed side outputs.
    Keeps where and what each side output was, not the tensor."""

    def __init__(self, sides: list[SideOutput]) -> None:
        super().__init__()
        self._want = [(s.position, s.shape, s.dtype, s.source) for s in sides]
        self._places = {s.position for s in sides}
        self._calls = {s.position[0] for s in sides}
        self._found: dict[tuple[int, int], torch.Tensor] = {}

    def note(self, call: int, module, output) -> None:
        if call in self._calls:
            for j, t in enumerate(_tensor_leaves(output)):
                if (call, j) in self._places:
                    self._found[(call, j)] = t

    def tensors(self, block: int) -> list[torch.Tensor]:
        out = []
        for k, (position, shape, dtype, source) in enumerate(self._want):
            t = self._found.get(position)
            if t is None or t.shape != shape or t.dtype != dtype:
                got = "nothing" if t is None else _describe(t)
                raise RuntimeError(
                    f"block {block}'s recompute gave {got} where its forward gave side output {k} "
                    f"({source}, {tuple(shape)} {str(dtype).removeprefix('torch.')}): the block must "
                    "call its submodules the same way each time it runs")
            out.append(t)
        self._found.clear()
        return out


class _Attach(torch.autograd.Function):
    """forward(source, escaped) -> the escaped tensor object itself, now an output of this Function
    (autograd sets the history of a new output in place, so the object's holders see it); its
    gradient goes to ``source`` as it is."""

    @staticmethod
    def forward(ctx, source, held):
        return held[0]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def attach(sides: list[SideOutput], sources) -> None:
    """Connect each escaped tensor to its source (the alias the block's Function returned for it, or
    the relay's leaf for that alias): gradients into the escaped tensor go to the source."""
    for side, source in zip(sides, sources):
        _Attach.apply(source, (side.tensor,))


_NOT_DIFFERENTIABLE = frozenset((
    "detach", "detach_", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"))
"""Torch functions whose floating-point result never requires grad, whatever their arguments."""


def _held_from_python(t: torch.Tensor) -> bool:
    """Whether a Python object (a list, a dict, an object's attributes) refers to ``t``. A tensor
    only C++ holds (a collective's pending work keeps its buffer) has escaped to no one's code.
    NOTE: a heap scan (ms): strict mode only, and only for a tensor that outlived its block."""
    return any(not isinstance(r, types.FrameType) for r in gc.get_referrers(t))


class _MadeInBlock(TorchFunctionMode):
    """Strict mode: every tensor a torch function returns inside the block that would require grad
    in plain PyTorch (it is floating point and one of the function's tensor arguments requires grad,
    or would), noted weakly with the function's name."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, tuple[weakref.ref, str]] = {}

    def _would_require_grad(self, t: torch.Tensor) -> bool:
        if t.requires_grad:
            return True
        entry = self._made.get(id(t))
        return entry is not None and entry[0]() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _NOT_DIFFERENTIABLE:
            return out
        ins = _tensor_leaves((args, kwargs))
        if any(self._would_require_grad(x) for x in ins):
            name = getattr(func, "__qualname__", None) or name or repr(func)
            for t in _tensor_leaves(out):
                if (t.is_floating_point() or t.is_complex()) and not any(t is x for x in ins):
                    self._made[id(t)] = (weakref.ref(t), name)
        return out

    def check(self, block: int, accounted: set[int], inputs, outputs, sides: list[SideOutput]) -> None:
        kept = [t for t in inputs if isinstance(t, torch.Tensor)] + list(outputs) + [s.tensor for s in sides]
        accounted = accounted | {id(t._base) for t in kept if t._base is not None}  # a view keeps its base
        for ref, name in self._made.values():
            t = ref()
            if t is not None and id(t) not in accounted and _held_from_python(t):
                self._made.clear()
                raise RuntimeError(
                    f"strict: block {block} lets a tensor it made escape ({_describe(t)}, from {name}), not "
                    "returned by the block nor by one of its submodules: it would leave without its "
                    "gradient (the block's forward runs without a graph); return it from the block or "
                    "from a submodule")
        self._made.clear()
