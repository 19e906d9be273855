"""The relay schedule (L2L, Pudipeddi et al. 2020): a step's m micro-batches run *layer-major*, so
each streamed block crosses the link once per pass however large m is.

Forward: each micro-batch's forward runs in a thread of its own (the first on the caller's) and a
*baton*, handed on round-robin at each streamed block, lets one run at a time, so the engine sees
``fwd 0 x m, fwd 1 x m, ...``. Backward runs in explicit stages, last block first, over a graph cut
at every streamed block's outputs. NOTE: autograd alone would not run it layer-major: it orders
ready nodes by a thread-local sequence number. The threads carry the caller's grad mode, autocast
and CUDA device and stream, no other thread-local state. docs/DESIGN.md, "Relay schedule".
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from pystronghold.runtime.blocks import autocast_state
from pystronghold.runtime.streaming.saved_inputs import SavedInputs

if TYPE_CHECKING:
    from pystronghold.runtime.streaming.executor import PassExecutor

__all__ = ["Relay", "RelayAborted", "accumulate"]

log = logging.getLogger(__name__)


class RelayAborted(RuntimeError):
    """Raised in a micro-batch thread when another micro-batch failed."""


class Relay:
    """One relay pass in progress: the baton of the micro-batch threads, the cut block outputs and
    the block inputs staged to host memory."""

    def __init__(self, micro_batches: int, backend=None, device_budget_bytes: int | None = None,
                 strict: bool = False, track=None, timed: bool = False) -> None:
        """``device_budget_bytes``: device bytes the saved block inputs of the pass may hold; those
        beyond are staged through host memory (``backend``'s copies). None: all stay on the device.
        ``strict``: a restored storage is filled with NaN bytes before its copy back, so a missing
        copy or wait shows up as wrong numbers. ``track``, ``timed``: ``saved_inputs.SavedInputs``'s."""
        self.micro_batches = micro_batches
        # NOTE: shrunk in place: the cuts keep the block outputs, which are the next blocks' inputs
        self._inputs = SavedInputs(backend, device_budget_bytes, strict=strict, shrink=True, track=track,
                                   timed=timed)
        self._cond = threading.Condition()
        self._holder = 0
        self._finished = [False] * micro_batches
        self._failed = False
        self._local = threading.local()
        # per micro-batch, per block call in call order: (block, real outputs, leaves handed on)
        self.cuts: list[list[tuple[int, list[torch.Tensor], list[torch.Tensor]] | None]] = \
            [[] for _ in range(micro_batches)]

    # ---- the baton

    def _index(self) -> int:
        index = getattr(self._local, "index", None)
        if index is None:
            raise RuntimeError("relay: a block ran outside the micro-batch threads of engine.accumulate "
                               "(a training forward in another thread during the relay pass)")
        return index

    def _wait(self, j: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == j or self._failed)
            if self._failed:
                raise RelayAborted("relay: another micro-batch failed")

    def _hand_on(self, j: int) -> None:
        """Give the baton to the next unfinished micro-batch after j (round-robin); call holding it."""
        m = self.micro_batches
        for step in range(1, m + 1):
            nxt = (j + step) % m
            if not self._finished[nxt]:
                self._holder = nxt
                break
        self._cond.notify_all()

    def arrive(self) -> None:
        """A micro-batch reached a streamed block: every other one reaches it before this one runs it."""
        j = self._index()
        with self._cond:
            self._hand_on(j)
        self._wait(j)

    # ---- forward

    def cut(self, block: int, outputs: tuple) -> tuple:
        """Outputs of a block call -> what the model continues with: every output that requires grad
        becomes a detached leaf; the real outputs are kept for the backward stage of this block.
        (The block's side outputs are among them: ``side_outputs.attach`` hangs each escaped tensor
        on its leaf.)"""
        reals, leaves, handed = [], [], []
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = t.detach().requires_grad_()
                reals.append(t)
                leaves.append(leaf)
                handed.append(leaf)
            else:
                handed.append(t)
        self.cuts[self._index()].append((block, reals, leaves))
        return tuple(handed)

    def forward(self, micro_batches: Sequence, loss_fn: Callable[[Any], torch.Tensor],
                device: torch.device) -> list[torch.Tensor]:
        """Run ``loss_fn(micro_batches[j])`` for every j, layer-major; returns the m losses (graphs kept)."""
        m = self.micro_batches
        losses: list[torch.Tensor | None] = [None] * m
        errors: list[BaseException | None] = [None] * m
        grad_enabled = torch.is_grad_enabled()
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        autocast = autocast_state.capture(device)

        def run(j: int) -> None:
            self._local.index = j
            try:
                with contextlib.ExitStack() as thread_state:
                    if j > 0:  # a new thread: the caller's grad mode, autocast, device and stream
                        torch.set_grad_enabled(grad_enabled)
                        thread_state.enter_context(autocast_state.entered(autocast))
                        if stream is not None:
                            torch.cuda.set_device(device)
                            torch.cuda.set_stream(stream)
                    self._wait(j)
                    loss = loss_fn(micro_batches[j])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(f"accumulate: loss_fn must return a one-element tensor, got "
                                    f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
                losses[j] = loss
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
                errors[j] = exc
                with self._cond:
                    self._failed = True
                    self._cond.notify_all()
            finally:
                with self._cond:
                    self._finished[j] = True
                    if self._holder == j:
                        self._hand_on(j)
                self._local.index = None

        # NOTE: micro-batch 0 runs on the calling thread (with m = 1 no thread and no hand-off at all)
        threads = [threading.Thread(target=run, args=(j,), name=f"pystronghold-relay-{j}", daemon=True)
                   for j in range(1, m)]
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, RelayAborted)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return losses

    def keep_or_stage(self, block: int, saved: list[torch.Tensor]) -> None:
        """The tensors a call of ``block`` saves for its recompute: kept on the device while the
        budget allows, else copied to host memory and their device storage freed (restored before
        the block's backward stage). Only storages made by this forward are staged (a cut leaf, an
        op's output or a view of one): a user's input tensor or a parameter view is never touched."""
        j = self._index()
        call = len(self.cuts[j])  # the call being made: its cut is appended after the forward
        leaves = {id(leaf) for c in self.cuts[j] if c is not None for leaf in c[2]}
        self._inputs.keep_or_stage((j, call), block, saved, owned=leaves)

    @property
    def device_bytes(self) -> int:
        """Saved block inputs of the pass kept on the device."""
        return self._inputs.device_bytes

    @property
    def staged_bytes(self) -> int:
        """... and staged to host memory."""
        return self._inputs.staged_bytes

    # ---- backward

    def backward(self, losses: list[torch.Tensor], scale_loss: Callable[[torch.Tensor], torch.Tensor],
                 mean: bool) -> None:
        """Back-propagate ``sum(losses) (/ m when mean)`` in stages: the tails, then each block's m
        micro-batches from the last block to the first (see the module docstring)."""
        m = self.micro_batches
        self._inputs.free_copied(wait=True)
        calls = {len(c) for c in self.cuts}
        if len(calls) != 1:
            raise RuntimeError(f"relay: the micro-batches called different numbers of blocks {sorted(calls)}")
        for j, loss in enumerate(losses):
            # NOTE: loss / m, as the default loop back-propagates each micro-batch (not x (1/m))
            torch.autograd.backward(scale_loss(loss / m if mean and m > 1 else loss), retain_graph=True)
            losses[j] = None
        for pos in reversed(range(calls.pop())):
            # staged inputs of this stage, and of the next one while this one computes
            for later in (pos, pos - 1) if pos > 0 else (pos,):
                for j in range(m):
                    self._inputs.issue_restore((j, later))
            for j in range(m):
                block, reals, leaves = self.cuts[j][pos]
                self.cuts[j][pos] = None  # the stage's graph goes once the backward has run
                self._inputs.restored((j, pos))  # compute waits for its staged inputs
                pairs = [(r, leaf.grad) for r, leaf in zip(reals, leaves) if leaf.grad is not None]
                if not pairs:
                    raise RuntimeError(f"relay: block {block}'s outputs got no gradient in micro-batch {j}: "
                                       "the loss does not depend on every block")
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs], retain_graph=True)


def accumulate(executor: PassExecutor, micro_batches: Sequence, loss_fn: Callable[[Any], torch.Tensor], *,
               backward: Callable[[torch.Tensor], None], scale_loss: Callable[[torch.Tensor], torch.Tensor],
               mean: bool = True) -> torch.Tensor:
    """``engine.accumulate``: forward and backward of every micro-batch, layer-major with the relay
    schedule (one relay pass), else one after the other; returns the detached losses, shape (m,).
    ``executor``: the engine's pass executor, which the relay drives (its config, backend, trace and
    backward count say how); ``backward``: back-propagates one loss outside a relay pass;
    ``scale_loss``: the fp16 loss scale of every loss a relay pass back-propagates."""
    config = executor.config
    m = len(micro_batches)
    if m < 1:
        raise ValueError("accumulate: micro_batches is empty")
    if executor.micro_batches + m > config.accumulation_steps:
        raise ValueError(f"accumulate: {m} micro-batches after {executor.micro_batches} backward passes exceed "
                         f"accumulation_steps={config.accumulation_steps}")
    if config.schedule_mode != "relay" or not executor.n_streamed:
        losses = []
        for item in micro_batches:
            loss = loss_fn(item)
            backward(loss / m if mean and m > 1 else loss)
            losses.append(loss.detach().reshape(()))
        return torch.stack(losses)
    if executor.in_pass():
        raise RuntimeError("accumulate: a forward/backward pass is already in progress")
    relay = Relay(m, executor.backend, config.relay_activation_bytes, strict=config.strict,
                  track=executor.track_copy, timed=executor.trace.enabled)
    executor.relay = relay
    try:
        losses = relay.forward(micro_batches, loss_fn, executor.backend.device)
        values = torch.stack([loss.detach().reshape(()) for loss in losses])
        relay.backward(losses, scale_loss, mean)
    except BaseException:
        executor.abandon_pass()
        raise
    finally:
        executor.relay = None
    if executor.in_pass():
        executor.abandon_pass()
        raise RuntimeError("accumulate: the relay backward did not reach the first block")
    executor.relay_activations = dict(device_bytes=relay.device_bytes, staged_bytes=relay.staged_bytes)
    log.debug("relay pass: saved block inputs %d bytes on the device, %d staged to host memory",
              relay.device_bytes, relay.staged_bytes)
    return values
