"""Inputs of an engine call: host tensors moved to the engine's device, tensors on another device
refused naming the argument. The moves are checked on the CPU with the ``meta`` device standing in
for the GPU; the CUDA test runs only where there is one."""

from __future__ import annotations

import inspect
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.blocks.inputs import forward_signature, move_inputs, on_device
from runtime_models import gpt_batches, tiny_gpt

META = torch.device("meta")
Pair = namedtuple("Pair", "a b")


def forward(x, targets=None, *rest, mask=None):
    raise AssertionError("only the signature is used")


SIG = inspect.signature(forward)


def test_host_tensors_in_nested_arguments_move_and_the_rest_is_kept():
    x, y, m = torch.ones(2, 3), torch.arange(4), torch.zeros(5, dtype=torch.bool)
    args = (x, [y, {"k": m, "n": 7}], Pair(x, "s"))
    kwargs = {"mask": (m, None), "scale": 2.5}
    new_args, new_kwargs = move_inputs(args, kwargs, META, SIG)
    assert new_args[0].device == META and new_args[0].shape == x.shape and new_args[0].dtype == x.dtype
    assert new_args[1][0].device == META and new_args[1][0].dtype == torch.int64
    assert new_args[1][1]["k"].device == META and new_args[1][1]["n"] == 7
    assert isinstance(new_args[2], Pair) and new_args[2].a.device == META and new_args[2].b == "s"
    assert new_kwargs["mask"][0].device == META and new_kwargs["mask"][1] is None
    assert new_kwargs["scale"] == 2.5
    assert x.device.type == "cpu"  # the caller's tensors are not changed


def test_tensors_already_on_the_device_pass_as_they_are():
    a, b = torch.empty(3, device=META), torch.empty(2, device=META)
    args, kwargs = (a,), {"targets": b}
    new_args, new_kwargs = move_inputs(args, kwargs, META, SIG)
    assert new_args[0] is a and new_kwargs["targets"] is b
    host = torch.ones(2)
    out_args, _ = move_inputs((host,), {}, "cpu", SIG)  # the CPU backend: nothing to move
    assert out_args[0] is host


def test_gradients_flow_through_the_move():
    w = torch.ones(3, requires_grad=True)
    (moved,), _ = move_inputs((w * 2,), {}, META, SIG)
    assert moved.requires_grad and moved.grad_fn is not None


@pytest.mark.parametrize("args, kwargs, name", [
    ((torch.empty(2, device=META),), {}, "x"),
    ((torch.ones(1), torch.empty(2, device=META)), {}, "targets"),
    ((1, 2, 3, torch.empty(2, device=META)), {}, "rest[1]"),
    ((torch.ones(1),), {"mask": {"pad": [torch.empty(1, device=META)]}}, "mask['pad'][0]"),
])
def test_a_tensor_on_another_device_is_refused_naming_the_argument(args, kwargs, name):
    with pytest.raises(ValueError) as exc:
        move_inputs(args, kwargs, "cpu", SIG)
    msg = str(exc.value)
    assert msg == (f"engine(...): argument {name!r} is on meta but the engine runs on cpu; "
                   "move it to cpu or to the host")


def test_without_a_signature_positions_are_named():
    with pytest.raises(ValueError, match=r"argument 'args\[1\]' is on meta"):
        move_inputs((torch.ones(1), torch.empty(1, device=META)), {}, "cpu", None)


def test_device_index_matching():
    """A device without an index matches every index; another GPU does not match."""
    on = lambda where, target: on_device(SimpleNamespace(device=torch.device(where)), torch.device(target))  # noqa: E731
    assert on("cuda:1", "cuda") and on("cuda:0", "cuda:0") and on("cpu", "cpu")
    assert not on("cuda:1", "cuda:0") and not on("cpu", "cuda:0") and not on("cuda:0", "cpu")


def test_engine_refuses_an_input_on_another_device_naming_it():
    engine = ph.wrap(tiny_gpt(layers=2), window=1)
    try:
        x, y = gpt_batches(1)[0]
        with pytest.raises(ValueError, match="argument 'idx' is on meta but the engine runs on cpu"):
            engine(x.to("meta"), y)
        with pytest.raises(ValueError, match="argument 'targets' is on meta"):
            engine(x, targets=y.to("meta"))
        assert forward_signature(engine.model) is not None
        engine.backward(engine(x, y))  # and a normal call still trains
        engine.step()
    finally:
        engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [False, True])
def test_cuda_engine_takes_host_inputs(pinned):
    """engine(x_cpu, y_cpu) on CUDA: the same loss and gradients as with inputs already on the GPU."""
    torch.manual_seed(0)
    x, y = gpt_batches(1)[0]
    if pinned:
        x, y = x.pin_memory(), y.pin_memory()
    losses = []
    for to_gpu in (True, False):
        engine = ph.wrap(tiny_gpt(layers=3), window=2, device="cuda")
        try:
            loss = engine(x.cuda(), y.cuda()) if to_gpu else engine(x, targets=y)
            assert loss.device.type == "cuda"
            engine.backward(loss)
            engine.step()
            losses.append((float(loss), float(engine(x.cuda(), y.cuda()))))
        finally:
            engine.close()
    assert losses[0][0] == losses[1][0]  # the same forward on the same values: bit for bit
    # NOTE: after a step, default fp32 tolerance: a GPU backward may sum in a different order
    torch.testing.assert_close(losses[0][1], losses[1][1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_engine_refuses_an_input_on_another_gpu():
    engine = ph.wrap(tiny_gpt(layers=2), window=1, device="cuda:0")
    try:
        x, y = gpt_batches(1)[0]
        with pytest.raises(ValueError, match="argument 'idx' is on cuda:1 but the engine runs on cuda:0"):
            engine(x.to("cuda:1"), y)
    finally:
        engine.close()
