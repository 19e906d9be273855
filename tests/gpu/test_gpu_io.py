"""Pinned host arenas and the copy engine's host<->device copies on a real GPU."""

import threading
import time
import warnings

import pytest
import torch

from pystronghold._ext import native
from pystronghold.io import CopyEngine, HostArena

MiB = 1 << 20
BUSY_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of a busy current stream


def test_pin_cuda_registers_the_arena(cuda_build):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed registration warns (HostArena's pin_warning)
        arena = HostArena(8 * MiB, pin="cuda")
    assert arena.pinned
    view = arena.allocate("x", (MiB,), torch.float32)
    # CUDA sees the registered pages as page-locked host memory (cudaPointerGetAttributes: the copy
    # engine's test for direct DMA). NOTE: not torch's view.is_pinned(), which said False for them
    # on an H100 with torch 2.11 while copies from them ran at pinned speed (docs/BENCHMARKS.md)
    assert native().page_locked(view)
    assert HostArena(MiB, pin="auto").pinned  # with a device, "auto" pins too
    plain = HostArena(MiB, pin="none")
    assert not plain.pinned and not native().page_locked(plain.allocate("y", (16,), torch.uint8))


def test_pinned_arena_round_trips_through_the_device_asynchronously(cuda_build):
    arena = HostArena(16 * MiB, pin="cuda")
    src = arena.allocate("src", (2 * MiB,), torch.float32)
    back = arena.allocate("back", (2 * MiB,), torch.float32)
    src.copy_(torch.randn(2 * MiB))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dev = src.to("cuda", non_blocking=True)
        back.copy_(dev, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, src)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("nbytes", [4096, 3 * MiB + 100], ids=["one-chunk", "chunked-ragged"])
def test_copy_engine_h2d_and_d2h(cuda_build, pinned, nbytes):
    """H2D then D2H through the engine's own streams: direct DMA from pinned memory, staged through
    its pinned buffer from pageable memory; chunks of 1 MiB so a copy spans several workers."""
    arena = HostArena(2 * nbytes + 8192, pin="cuda" if pinned else "none")
    src = arena.allocate("src", (nbytes,), torch.uint8)
    back = arena.allocate("back", (nbytes,), torch.uint8)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    back.zero_()
    dev = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
    with CopyEngine(threads=2, chunk_bytes=MiB) as engine:
        up = engine.copy(dev, src, queue=0)
        down = engine.copy(back, dev, queue=1, after=[up])  # another queue: ordered by `after` only
        down.wait()
        assert up.done() and down.nbytes == nbytes
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    assert torch.equal(back, src)


def test_pinning_releases_the_gil(cuda_build):
    """cudaHostRegister faults in every page (the store pins 1 GiB chunks beside the fill), and
    unregistering and unmapping take time too (the store frees tens of GiB at close): this thread
    keeps running Python through the middle of another thread's pinning and of its release."""
    marks = {}

    def pin_then_free():
        marks["start"] = time.monotonic()
        arena = HostArena(1 << 30, pin="cuda")
        marks["pinned"], marks["made"] = arena.pinned, time.monotonic()
        del arena  # the last reference: unregistered and unmapped here
        marks["freed"] = time.monotonic()

    ticks = []
    thread = threading.Thread(target=pin_then_free)
    thread.start()
    while thread.is_alive():
        ticks.append(time.monotonic())
    thread.join()
    assert marks["pinned"]

    def ran_in_the_middle(start: float, end: float) -> bool:
        quarter = (end - start) / 4
        return any(start + quarter < t < end - quarter for t in ticks)

    pinning, freeing = marks["made"] - marks["start"], marks["freed"] - marks["made"]
    assert ran_in_the_middle(marks["start"], marks["made"]), \
        f"no Python ran in the middle of {pinning:.3f} s of pinning (then {freeing:.3f} s freeing): the GIL was held"
    # NOTE: only a release long enough to see: Python's switch interval is 5 ms
    assert freeing < 0.02 or ran_in_the_middle(marks["made"], marks["freed"]), \
        f"no Python ran in the middle of {freeing:.3f} s of unregistering and unmapping: the GIL was held"


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_copy_engine_waits_for_the_current_stream(cuda_build, pinned):
    """A copy starts after the work queued on torch's current stream when it was requested: a
    write of `dev` there, held back by a busy kernel, lands before the engine's H2D (which must
    win) and before its D2H (which must read it)."""
    nbytes = 3 * MiB + 100
    arena = HostArena(2 * nbytes + 8192, pin="cuda" if pinned else "none")
    src = arena.allocate("src", (nbytes,), torch.uint8)
    back = arena.allocate("back", (nbytes,), torch.uint8)
    src.copy_(torch.randint(1, 256, (nbytes,), dtype=torch.uint8))
    dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with CopyEngine(threads=2, chunk_bytes=MiB) as engine:
        torch.cuda._sleep(BUSY_CYCLES)
        dev.fill_(7)
        engine.copy(dev, src).wait()
        assert torch.equal(dev.cpu(), src)  # the fill came first
        torch.cuda._sleep(BUSY_CYCLES)
        dev.fill_(9)
        engine.copy(back, dev).wait()
        assert bool((back == 9).all())  # the D2H read the fill, not what was there before


def test_copy_engine_refuses_device_to_device(cuda_build):
    a, b = (torch.zeros(1024, device="cuda") for _ in range(2))
    with CopyEngine() as engine, pytest.raises(RuntimeError, match="device-to-device copies are not supported"):
        engine.copy(a, b)
