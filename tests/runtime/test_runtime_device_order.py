"""What the executor and the file tier ask of a CUDA-like backend, and in which order, on the CPU.

``StreamTwin`` wraps the CPU backend and hands out handles the way the CUDA backend does: a
compute marker is an event (numbered, not a copy-engine request), a copy's handle is not a
``CopyHandle`` (the file engine cannot wait on it), and a load stream that waited for a marker
runs every later load after it (a stream is in order). The twin records what a GPU would run in
which order, so the tests can check it without one.
"""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch

from pystronghold.runtime.memory.disk_tier import DiskTier
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import HetStack, het_batches, one_torch_thread, train_engine

_threads = pytest.fixture(autouse=True)(one_torch_thread)


class Marker:
    """A compute marker: an event on the compute stream (compute has run when the host gets it)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def done(self) -> bool:
        return True

    def wait(self, timeout_s=None) -> None:
        pass


class DeviceCopy:
    """A copy's handle as the CUDA backend's ``EventHandle`` is to the file tier: not a CopyHandle.
    ``host_waits_in_release`` counts the host waits made from ``DiskTier.release``."""

    in_release = threading.local()
    host_waits_in_release = 0

    def __init__(self, inner) -> None:
        self.inner = inner

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout_s=None) -> None:
        if getattr(DeviceCopy.in_release, "on", False):
            DeviceCopy.host_waits_in_release += 1
        self.inner.wait()

    def __getattr__(self, name):  # nbytes, start_s, end_s
        return getattr(self.inner, name)


class StreamTwin:
    """The CPU backend with CUDA's handles and a record of the order a GPU would run things in."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seq = itertools.count()
        self.poisoned: dict[int, int] = {}  # data_ptr -> seq of its last NaN fill
        self.h2d_after = -1  # the load stream has waited for every marker up to this seq
        self.races: list[str] = []  # loads that a GPU could run before a fill of their slot
        self.timed: list[bool] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _engine_handles(self, after):
        return [h.inner if isinstance(h, DeviceCopy) else h for h in after
                if h is not None and not isinstance(h, Marker)]

    def compute_marker(self) -> Marker:
        return Marker(next(self.seq))

    def compute_wait(self, handle) -> None:
        if isinstance(handle, DeviceCopy):
            handle.inner.wait()  # compute runs on this thread: it must have the bytes

    def poison(self, tensor) -> None:
        self.poisoned[tensor.data_ptr()] = next(self.seq)
        self.inner.poison(tensor)

    def device_buffer(self, name, numel, dtype):
        """A slot buffer: the window fills it on the compute stream as it makes it (counted as a
        write the next load into it must wait for, like a NaN fill)."""
        buffer = self.inner.device_buffer(name, numel, dtype)
        self.poisoned[buffer.data_ptr()] = next(self.seq)
        return buffer

    def h2d(self, dst, src, after=(), *, timed=False):
        self.timed.append(timed)
        markers = [h.seq for h in after if isinstance(h, Marker)]
        self.h2d_after = max([self.h2d_after, *markers])
        fill = self.poisoned.get(dst.data_ptr())
        if fill is not None and self.h2d_after < fill:
            self.races.append(f"a load into {dst.data_ptr():#x} after marker {self.h2d_after}, "
                              f"its slot was NaN-filled at {fill}")
        return DeviceCopy(self.inner.h2d(dst, src, self._engine_handles(after)))

    def d2h(self, dst, src, after=(), *, timed=False):
        self.timed.append(timed)
        return DeviceCopy(self.inner.d2h(dst, src, self._engine_handles(after)))


def _twin_hook(twins: list):
    def hook(engine):
        executor = engine_parts_for_tests(engine)["executor"]
        twin = StreamTwin(executor.backend)
        executor.backend = twin
        twins.append(twin)
    return hook


def _twins_from_build(monkeypatch) -> list:
    """Every backend ``wrap`` makes from now on, wrapped in a ``StreamTwin`` before the engine is
    built, so the twin sees the fills the build queues too."""
    from pystronghold.runtime import build

    twins = []
    made = build.make_backend

    def twin_backend(*args, **kwargs):
        twins.append(StreamTwin(made(*args, **kwargs)))
        return twins[-1]

    monkeypatch.setattr(build, "make_backend", twin_backend)
    return twins


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("window", [1, 2, "all"])
def test_a_slots_first_load_waits_for_the_fill_that_made_it(monkeypatch, window, strict):
    """The window zero-fills its new slots on the compute stream, and strict mode NaN-fills them
    after that; their first loads (the copy stream) must wait for the last of those fills, or on a
    busy GPU the fill lands on the loaded block (seen on an H100 with four test processes sharing it:
    W=all lost its first step)."""
    twins = _twins_from_build(monkeypatch)
    train_engine(HetStack(), het_batches(2), window=window, strict=strict)
    assert twins and twins[0].poisoned, "the twin saw no slot buffer"
    assert twins[0].races == []


def test_strict_mode_poisons_a_released_slot_before_the_marker_the_next_load_waits_for(monkeypatch):
    twins = _twins_from_build(monkeypatch)
    train_engine(HetStack(), het_batches(4), window=2, strict=True)
    twin = twins[0]
    assert twin.poisoned, "strict mode poisoned no slot"
    assert twin.races == []


@pytest.mark.parametrize("trace", [False, True])
def test_copies_ask_for_device_times_only_when_tracing(trace):
    twins = []
    train_engine(HetStack(), het_batches(2), window=2, trace=trace, engine_hook=_twin_hook(twins))
    assert twins[0].timed and set(twins[0].timed) == {trace}


@pytest.mark.parametrize("options", [dict(overlap="forward"), dict(accumulation=2, strict=True)],
                         ids=["forward", "accumulation"])
def test_the_file_tier_never_blocks_the_host_on_a_device_copy(tmp_path, monkeypatch, options):
    """Loads and gradient copy-outs through the disk cache: their write-backs wait for the device
    copies without the host waiting at release, and the training is the one in host memory."""
    release = DiskTier.release

    def watched_release(self, *args, **kwargs):
        DeviceCopy.in_release.on = True
        try:
            return release(self, *args, **kwargs)
        finally:
            DeviceCopy.in_release.on = False

    monkeypatch.setattr(DiskTier, "release", watched_release)
    monkeypatch.setattr(DeviceCopy, "host_waits_in_release", 0)
    model = HetStack()
    disk_model = copy.deepcopy(model)
    torch.manual_seed(1234)
    ram_losses, ram_params, _ = train_engine(model, het_batches(8), window=2, **options)
    torch.manual_seed(1234)
    twins = []
    losses, params, engine = train_engine(disk_model, het_batches(8), window=2, nvme_dir=str(tmp_path / "nvme"),
                                          nvme_states="all", engine_hook=_twin_hook(twins), **options)
    assert DeviceCopy.host_waits_in_release == 0
    assert not engine.placement.streamed_grads and engine.stats()["disk"]["write_bytes"] > 0
    assert losses == ram_losses
    for name, p in ram_params.items():
        assert torch.equal(params[name], p), name
    assert twins[0].races == []
