"""How the engine gets into the model: one autograd Function around each block's forward.

Forward waits for the block's load, runs without building a graph (only inputs are saved:
activation checkpointing) and releases the slot; backward waits for the (re)load, recomputes with
grad, hands the trainable parameters' gradients to the engine in one flat buffer and returns the
input gradients. Autograd never touches an offloaded parameter's ``.grad``. The wrapper replaces
the instance's ``forward`` attribute, so names, ``state_dict`` keys and hooks are unchanged.
Nested arguments and outputs are flattened with pytree; side-channel outputs (Hugging Face
recorders) are carried as extra outputs (``side_outputs.py``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.utils import _pytree as pytree

from pystronghold.runtime.blocks import autocast_state
from pystronghold.runtime.blocks.purity import argument_name, fingerprint, is_mutable_cache, output_checksums
from pystronghold.runtime.blocks.side_outputs import Replay, Watch, attach

__all__ = ["install", "BlockFunction", "BlockRunner"]


class BlockRunner(NamedTuple):
    """What ``BlockFunction`` runs a block with: the engine (its per-block calls, config, device),
    its pass executor (``executor.PassExecutor``) and its window (``window.Window``)."""

    engine: object
    executor: object
    window: object


def _rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _run_with_rng(state, device, fn):
    """Run ``fn`` with the RNG state of the original forward (so dropout masks repeat exactly)."""
    cpu, cuda = state
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        return fn()


def _slot_pack_hooks(window, block: int):
    """saved_tensors_hooks that store slot views by position, so they survive eviction and reload."""
    base = window.resident[block].params
    lo, itemsize = base.data_ptr(), base.element_size()
    hi = lo + base.numel() * itemsize
    device, dtype, storage = base.device, base.dtype, base.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        # NOTE: the cheap address test first: it rejects most saved tensors (activations); called
        # for every tensor every block saves
        ptr = t.data_ptr()
        if lo <= ptr < hi and t.untyped_storage().data_ptr() == storage and t.dtype == dtype \
                and t.device == device:
            return ("slot", (ptr - lo) // itemsize, tuple(t.shape), tuple(t.stride()))
        # NOTE: an alias, not the tensor object: the graph must not keep the block's intermediate
        # tensors alive, or every saved one would look like a side output (side_outputs.py)
        return ("keep", t.detach())

    def unpack(packed):
        if packed[0] == "keep":
            return packed[1]
        _, rel, shape, stride = packed
        now = window.resident[block].params  # the slot the block was reloaded into
        return now.as_strided(shape, stride, now.storage_offset() + rel)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _fingerprints(block: int, spec, flat) -> dict[int, object]:
    """Fingerprints of the non-tensor arguments of a block call that will be recomputed; a
    Hugging Face KV cache among them is refused (each call appends to it)."""
    prints = {}
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            continue
        if is_mutable_cache(x):
            raise ValueError(
                f"block {block} got a Hugging Face {type(x).__name__} as {argument_name(spec, i)} in a "
                "training forward: its recompute would append to the cache a second time and compute "
                "something else; call the model with use_cache=False (wrap turns the cache off in "
                "training forwards unless use_cache= is passed explicitly)")
        prints[i] = fingerprint(x)
    return prints


def _check_unchanged(block: int, spec, flat, prints: dict, when: str) -> None:
    for i, before in prints.items():
        if fingerprint(flat[i]) != before:
            raise ValueError(
                f"block {block}'s non-tensor argument {argument_name(spec, i)} ({type(flat[i]).__name__}) "
                f"changed {when}: the backward recompute would not see what the forward saw; blocks must "
                "not mutate their non-tensor arguments (pass state as tensors, or turn the cache off)")


def _check_same_output(block: int, checksums: list, outs) -> None:
    got = output_checksums(outs)
    for k, (want, have) in enumerate(zip(checksums, got)):
        if want != have:
            raise RuntimeError(
                f"strict: block {block}'s recomputed output {k} differs from its forward output "
                f"(checksum {have} != {want}): the block is not pure (hidden state, or randomness "
                "outside torch's RNG)")
    if len(checksums) != len(got):
        raise RuntimeError(f"strict: block {block}'s recompute returned {len(got)} tensors, its "
                           f"forward {len(checksums)}")


class BlockFunction(torch.autograd.Function):
    """forward(runner, block, train, spec, box, anchor, *flat_args) -> tensor outputs of the block,
    then an alias of each of its side outputs (``box["sides"]``)."""

    @staticmethod
    def forward(ctx, runner: BlockRunner, block, train, spec, box, anchor, *flat):
        engine = runner.engine
        fn = engine.block_forwards[block]
        keep = train and not engine.config.checkpointing
        recompute = train and not keep
        prints = _fingerprints(block, spec, flat) if recompute else None
        watch = Watch(block, box["module"], engine.config.strict) if train else contextlib.nullcontext()
        engine.enter(block, "fwd", train)
        with engine.span("compute_fwd", block):
            if keep:
                inputs = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                          for x in flat]
                args, kwargs = pytree.tree_unflatten(inputs, spec)
                with torch.enable_grad(), _slot_pack_hooks(runner.window, block), watch:
                    out = fn(*args, **kwargs)
            else:
                rng = _rng_state(engine.device) if train else None
                autocast = autocast_state.capture(engine.device) if train else None
                args, kwargs = pytree.tree_unflatten(list(flat), spec)
                with watch:
                    out = fn(*args, **kwargs)
        engine.leave(block, "fwd")
        if recompute:
            _check_unchanged(block, spec, flat, prints, "during its forward")
        leaves, out_spec = pytree.tree_flatten(out)
        is_t = [isinstance(x, torch.Tensor) for x in leaves]
        box["spec"], box["leaves"], box["is_tensor"] = out_spec, leaves, is_t
        tensors = [x for x, t in zip(leaves, is_t) if t]
        sides = watch.escaped(inputs if keep else flat, tensors) if train else []
        box["sides"] = sides
        if train:
            ctx.runner, ctx.block, ctx.spec, ctx.keep = runner, block, spec, keep
            ctx.is_input_tensor = [isinstance(x, torch.Tensor) for x in flat]
            if keep:
                with torch.enable_grad():  # the graph's own handle on each (attach rebinds the object)
                    privates = [s.tensor.view_as(s.tensor) for s in sides]
                ctx.graph = (tensors + privates, inputs)
            else:
                ctx.rng, ctx.autocast, ctx.prints = rng, autocast, prints
                ctx.replay = Replay(sides) if sides else None
                ctx.checksums = (output_checksums(tensors + [s.tensor for s in sides]) if engine.config.strict
                                 else None)
                ctx.non_tensor = [None if isinstance(x, torch.Tensor) else x for x in flat]
                saved = [x for x in flat if isinstance(x, torch.Tensor)]
                relay, offload = runner.executor.relay, runner.executor.saved_inputs
                ctx.staged = None
                if relay is not None:  # the relay: the m inputs of a block may go to the host
                    ctx.save_for_backward(*saved)
                    relay.keep_or_stage(block, saved)
                elif offload is not None:  # input offload: a staged input is not kept by the graph
                    key = offload.next_key()
                    staged = offload.keep_or_stage(key, block, saved)
                    ctx.save_for_backward(*[None if s else t for t, s in zip(saved, staged)])
                    ctx.staged = (offload, key)  # also when none is: its backward prefetches the next
                else:
                    ctx.save_for_backward(*saved)
        if keep:
            tensors = [t.detach() for t in tensors]
        return tuple(tensors) + tuple(s.tensor.detach() for s in sides)

    @staticmethod
    def backward(ctx, *grad_outs):
        runner, block = ctx.runner, ctx.block
        engine = runner.engine
        staged = None if ctx.keep else ctx.staged
        if staged is not None:
            # this block's inputs come back, and those of the one before it (the next backward)
            # while this one recomputes, as the weights are prefetched
            offload, key = staged
            offload.issue_restore(key)
            ahead = offload.previous(key)
            if ahead is not None:
                offload.issue_restore(ahead)
        engine.enter(block, "bwd", True)
        if ctx.keep:
            outs, inputs = ctx.graph
            del ctx.graph
        else:
            saved = ctx.saved_tensors
            if staged is not None:
                back = offload.restored(key)
                saved = [back.get(i, t) for i, t in enumerate(saved)]
                ctx.staged = None
            saved = iter(saved)
            needs = ctx.needs_input_grad[6:]  # one flag per flat argument
            inputs = [next(saved).detach().requires_grad_(need) if t else x
                      for t, x, need in zip(ctx.is_input_tensor, ctx.non_tensor, needs)]
            _check_unchanged(block, ctx.spec, inputs, ctx.prints, "between its forward and its recompute")
            args, kwargs = pytree.tree_unflatten(inputs, ctx.spec)
            fn = engine.block_forwards[block]
            replay = ctx.replay or contextlib.nullcontext()
            # NOTE: under the forward's autocast: backward usually runs after the caller's has closed
            with (engine.span("recompute", block), torch.enable_grad(), autocast_state.entered(ctx.autocast),
                  replay):
                out = _run_with_rng(ctx.rng, engine.device, lambda: fn(*args, **kwargs))
            outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
            if ctx.replay is not None:
                outs += ctx.replay.tensors(block)
            if ctx.checksums is not None:
                _check_same_output(block, ctx.checksums, outs)
        params = runner.window.trainable(block)  # frozen parameters get no gradient
        wrt_inputs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
        with engine.span("compute_bwd", block):
            if pairs and (wrt_inputs or params):
                grads = torch.autograd.grad([o for o, _ in pairs], wrt_inputs + list(params),
                                            [g for _, g in pairs], allow_unused=True)
            else:
                grads = (None,) * (len(wrt_inputs) + len(params))
        # NOTE: outside the compute span, which the engine's own per-block span must not overlap
        engine.leave(block, "bwd", param_grads=grads[len(wrt_inputs):])
        input_grads = iter(grads[:len(wrt_inputs)])
        flat_grads = [next(input_grads) if isinstance(x, torch.Tensor) and x.requires_grad else None
                      for x in inputs]
        return (None, None, None, None, None, None, *flat_grads)


def _skipped(block: int, args: tuple):
    """A block skipped by layer drop is the identity on its first argument (the hidden states)."""
    if not args or not isinstance(args[0], torch.Tensor):
        raise ValueError(f"layer_drop: block {block} must take its hidden states as first positional "
                         "argument (a skipped block passes them on)")
    return args[0]


def _check_droppable(block: int, args: tuple, leaves: list) -> None:
    """With layer drop, a block must map its first argument to one tensor of the same shape, or
    skipping it (the identity) would hand the model something else."""
    ok = (len(leaves) == 1 and isinstance(leaves[0], torch.Tensor) and args and isinstance(args[0], torch.Tensor)
          and leaves[0].shape == args[0].shape)
    if not ok:
        raise ValueError(f"layer_drop: block {block} must return one tensor shaped like its first argument "
                         "(the identity replaces it when it is skipped); use layer_drop=0 for this model")


def install(runner: BlockRunner, blocks: torch.nn.ModuleList) -> list:
    """Replace each block's ``forward`` with one that runs through BlockFunction with ``runner``.

    Returns the blocks' original forward callables, in block order.
    """
    engine, executor = runner.engine, runner.executor
    originals = []
    for index, module in enumerate(blocks):
        original = module.forward
        originals.append(original)

        def windowed_forward(*args, _index=index, **kwargs):
            if executor.layer_dropped(_index, torch.is_grad_enabled()):
                return _skipped(_index, args)  # layer drop: not loaded, not updated this step
            flat, spec = pytree.tree_flatten((args, kwargs))
            box: dict = {"module": blocks[_index]}
            relay = executor.relay if torch.is_grad_enabled() else None  # runtime/streaming/relay.py
            if relay is not None:
                relay.arrive()  # every micro-batch reaches this block before it runs for this one
            outs = BlockFunction.apply(runner, _index, torch.is_grad_enabled(), spec, box,
                                       engine.anchor, *flat)
            if relay is not None:
                outs = relay.cut(_index, outs)  # the backward of this block is driven by the relay
            sides = box["sides"]
            attach(sides, outs[len(outs) - len(sides):])
            outs = iter(outs)
            leaves = [next(outs) if t else x for x, t in zip(box["leaves"], box["is_tensor"])]
            if executor.layer_drop.enabled:
                _check_droppable(_index, args, leaves)
            return pytree.tree_unflatten(leaves, box["spec"])

        module.forward = windowed_forward
    return originals
