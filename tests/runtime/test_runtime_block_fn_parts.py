"""``block_fn.install`` runs a block through its autograd Function with the parts it is given (the
per-block calls, executor, window, recompute and purity settings, device, anchor), no engine: the
forward, the recompute in backward and the gradients handed out are those of the plain block."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import torch

from pystronghold.runtime.blocks import block_fn


class _Calls:
    """``BlockCalls`` that record each call and keep the gradients handed out."""

    def __init__(self) -> None:
        self.log: list[tuple[int, str]] = []
        self.grads = None

    def enter(self, block, phase, train):
        self.log.append((block, f"enter {phase}"))

    def leave(self, block, phase, param_grads=None):
        self.log.append((block, f"leave {phase}"))
        if phase == "bwd":
            self.grads = param_grads

    def span(self, kind, block, *, host=False):
        return contextlib.nullcontext()


def test_a_block_trains_through_the_parts_it_is_given():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    reference = copy.deepcopy(block)
    blocks = torch.nn.ModuleList([block])
    calls = _Calls()
    executor = SimpleNamespace(layer_dropped=lambda block, train: False, relay=None, saved_inputs=None,
                               layer_drop=SimpleNamespace(enabled=False))
    window = SimpleNamespace(trainable=lambda b: list(blocks[b].parameters()))
    originals = block_fn.install(blocks, calls=calls, executor=executor, window=window, checkpointing=True,
                                 strict=True, device=torch.device("cpu"),
                                 anchor=torch.zeros((), requires_grad=True))
    assert len(originals) == 1
    x = torch.randn(3, 4)
    out = blocks[0](x)
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x))
    assert calls.log == [(0, "enter fwd"), (0, "leave fwd"), (0, "enter bwd"), (0, "leave bwd")]
    for got, p in zip(calls.grads, reference.parameters()):
        torch.testing.assert_close(got, p.grad)
