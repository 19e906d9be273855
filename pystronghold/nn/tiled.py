"""A position-wise module run over tiles of the sequence, so that its working set does not grow
with T.

An MLP widens each token from C to F (4C, or 2 x 3.5C gated) and back: at long contexts its
(B, T, F) intermediate is the largest tensor a block makes, in its forward and again in its
recompute and backward. ``tiled`` runs a position-wise function (each output position depends on
its own input position only) over tiles of ``tile`` positions: forward without a graph, tile after
tile, into one output buffer; backward recomputes each tile with a graph, back-propagates it at
once (the input gradient into one buffer, the parameter gradients summed over the tiles in fp32)
and frees it. So at most one tile's intermediates are alive, for one more forward of the function
in backward. The idea is ALST's TiledMLP (Bekman et al. 2025, arXiv 2506.13996, section 3.2); the
code is ours.

Randomness (dropout) in the function repeats in the recompute: each tile runs under the RNG state
its forward had. Autocast too: the recompute runs under the forward's autocast state (backward
usually runs after the caller's ``with torch.autocast`` has closed).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

__all__ = ["tiled", "mlp_tile_tokens", "MLP_TILE_BUDGET_BYTES"]

MLP_TILE_BUDGET_BYTES = 256 * 2**20
"""Default bytes of one tile's MLP intermediate (``mlp_tile_tokens``): 256 MiB, 9,344 tokens of a
14,336-wide bf16 intermediate (Llama-3-8B) at batch 1."""


def mlp_tile_tokens(batch: int, seq: int, width: int, dtype_bytes: int,
                    budget_bytes: int = MLP_TILE_BUDGET_BYTES) -> int:
    """Tokens per tile (of each of the ``batch`` samples) of a tiled MLP whose intermediate is
    ``width`` elements of ``dtype_bytes`` bytes per token: 0 (untiled) when the whole
    ``batch x seq`` intermediate takes at most ``budget_bytes`` bytes, else the most tokens whose
    ``batch x tile`` intermediate does (at least 1; rounded down to a multiple of 64 past 64)."""
    for name, value in (("batch", batch), ("seq", seq), ("width", width), ("dtype_bytes", dtype_bytes),
                        ("budget_bytes", budget_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mlp_tile_tokens: {name} must be a positive int, got {value!r}")
    per_token = batch * width * dtype_bytes  # bytes of one position of every sample
    if seq * per_token <= budget_bytes:
        return 0
    tokens = max(1, budget_bytes // per_token)
    return tokens // 64 * 64 if tokens > 64 else tokens


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
          tile: int) -> torch.Tensor:
    """``fn(x)`` for a position-wise ``fn`` (x (B, T, C) -> (B, T, C')), computed over tiles of
    ``tile`` positions of the sequence (dim 1) so that its intermediates exist for one tile at a
    time, forward and backward.

    ``params``: the tensors ``fn`` uses that may need a gradient (a module's parameters; those not
    requiring grad are skipped); their gradients reach autograd as if ``fn(x)`` had run whole.
    ``tile`` <= 0, or at least T: ``fn(x)`` itself. ValueError (one line) when ``fn`` does not map
    each tile to one tensor of the tile's (B, t) positions.
    """
    if x.dim() < 2:
        raise ValueError(f"tiled: x must be (B, T, ...) with the sequence in dim 1, got shape {tuple(x.shape)}")
    if tile <= 0 or tile >= x.shape[1]:
        return fn(x)
    wrt = [p for p in params if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or wrt):
        return _forward_tiles(fn, x, tile)  # nothing to differentiate: no Function, no saved state
    return _Tiled.apply(fn, tile, x, *wrt)


# ---- forward over tiles

def _spans(length: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(start + tile, length)) for start in range(0, length, tile)]


def _checked(y, xt: torch.Tensor) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"tiled: the function returned {type(y).__name__}, not one tensor: only a position-wise "
                         "module with one tensor in and one out can run over tiles")
    if y.shape[:2] != xt.shape[:2]:
        raise ValueError(f"tiled: the function mapped a tile of shape {tuple(xt.shape)} to {tuple(y.shape)}: it "
                         "is not position-wise (the output must keep the input's (B, T) positions)")
    return y


def _forward_tiles(fn, x: torch.Tensor, tile: int, rng_states: list | None = None) -> torch.Tensor:
    """fn over the tiles of x, without a graph, into one output buffer; with ``rng_states`` (a
    list) each tile's RNG state is appended before it runs."""
    out = None
    with torch.no_grad():
        for start, stop in _spans(x.shape[1], tile):
            if rng_states is not None:
                rng_states.append(_rng_state(x.device))
            xt = x[:, start:stop].contiguous()  # NOTE: a copy when B > 1; modules may view() their input
            y = _checked(fn(xt), xt)
            if out is None:
                out = y.new_empty((*x.shape[:2], *y.shape[2:]))
            out[:, start:stop] = y
    return out


# ---- the state a recompute must repeat (RNG, autocast)

def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _rng_restored(state, device: torch.device):
    """The body runs under RNG ``state``; the caller's RNG state is back afterwards."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], enabled=True):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _autocast_state(device: torch.device) -> tuple[dict, ...]:
    """``torch.autocast`` keyword arguments that reproduce this thread's autocast state on the CPU
    and on ``device``'s type (enabled or not)."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(dict(device_type=kind, enabled=torch.is_autocast_enabled(kind), dtype=torch.get_autocast_dtype(kind),
                      cache_enabled=cache) for kind in dict.fromkeys(("cpu", device.type)))


def _autocast_entered(state: tuple[dict, ...]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for kwargs in state:
        stack.enter_context(torch.autocast(**kwargs))
    return stack


# ---- the autograd Function

def _accumulation_dtype(p: torch.Tensor) -> torch.dtype:
    """Parameter gradients are summed over the tiles in fp32 (fp64 stays fp64) and rounded once,
    as one whole matmul rounds them once."""
    return torch.promote_types(p.dtype, torch.float32) if p.is_floating_point() else p.dtype


class _Tiled(torch.autograd.Function):
    """forward(ctx, fn, tile, x, *params) -> fn(x), computed tile by tile (see ``tiled``)."""

    @staticmethod
    def forward(ctx, fn, tile, x, *params):
        rng_states: list = []
        out = _forward_tiles(fn, x, tile, rng_states)
        ctx.fn, ctx.tile, ctx.params, ctx.rng_states = fn, tile, params, rng_states
        ctx.autocast = _autocast_state(x.device)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[3:]) if need]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for (start, stop), rng in zip(_spans(x.shape[1], ctx.tile), ctx.rng_states):
            xt = x[:, start:stop].contiguous().detach().requires_grad_(need_x)
            with torch.enable_grad(), _autocast_entered(ctx.autocast), _rng_restored(rng, x.device):
                yt = ctx.fn(xt)
            wrt = ([xt] if need_x else []) + params
            grads = torch.autograd.grad(yt, wrt, grad_out[:, start:stop], allow_unused=True)
            del yt  # NOTE: this tile's graph goes before the next tile's is built
            if need_x:
                grad_x[:, start:stop] = grads[0] if grads[0] is not None else 0
            for i, g in enumerate(grads[len(wrt) - len(params):]):
                if g is None:
                    continue
                if sums[i] is None:
                    sums[i] = g.to(_accumulation_dtype(params[i]), copy=True)
                else:
                    sums[i] += g
        by_param = iter(None if s is None else s.to(p.dtype) for s, p in zip(sums, params))
        return (None, None, grad_x, *(next(by_param) if need else None for need in ctx.needs_input_grad[3:]))
