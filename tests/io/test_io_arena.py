"""The host arena: aligned views of any dtype, no overlap, clean refusal of over-asking."""

import gc
import re
import warnings

import pytest
import torch

from pystronghold.io import CopyEngine, HostArena

MiB = 1 << 20


def mem_total_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.mark.parametrize("alignment", [1, 64, 4096, 1 << 16])
def test_views_are_aligned_and_do_not_overlap(alignment):
    arena = HostArena(8 * MiB, alignment=alignment, pin="none")
    specs = [("a", (7,), torch.float32), ("b", (3, 17), torch.bfloat16), ("c", (1,), torch.uint8),
             ("d", (1023,), torch.float64), ("e", (), torch.int32), ("f", (0,), torch.float16),
             ("g", (2, 2, 5), torch.int64)]
    views = {name: arena.allocate(name, shape, dtype) for name, shape, dtype in specs}
    for (name, shape, dtype), t in zip(specs, views.values()):
        assert t.shape == torch.Size(shape) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % max(alignment, dtype.itemsize) == 0
    assert arena.base_address % max(alignment, 4096) == 0
    spans = sorted(arena.views().values())
    for (off1, n1), (off2, _) in zip(spans, spans[1:]):
        assert off1 + n1 <= off2
    for i, t in enumerate(views.values()):  # distinct fill per view, then every fill intact
        t.reshape(-1).view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(views.values()):
        assert bool((t.reshape(-1).view(torch.uint8) == i + 1).all())
    assert arena.used_bytes == spans[-1][0] + spans[-1][1] <= arena.capacity_bytes == 8 * MiB


def test_over_asking_the_host_fails_before_allocating():
    too_much = 4 * mem_total_bytes()
    with pytest.raises(RuntimeError, match=rf"capacity_bytes={too_much} is more than this host can give "
                                           r"\(MemAvailable \d+ bytes.*nothing was allocated"):
        HostArena(too_much, pin="none")


def test_over_asking_the_arena_names_the_numbers():
    arena = HostArena(10_000, alignment=4096, pin="none")
    arena.allocate("first", (1000,), torch.uint8)
    with pytest.raises(RuntimeError, match=re.escape(
            "HostArena.allocate('big'): needs 8000 bytes at offset 4096 (alignment 4096), but the arena "
            "holds 10000 bytes with 1000 used (5904 left after alignment)")):
        arena.allocate("big", (2000,), torch.float32)
    assert arena.used_bytes == 1000  # the failed request took nothing
    last = arena.allocate("fits", (1476,), torch.float32)  # exactly the 5904 bytes left
    assert last.numel() == 1476 and arena.used_bytes == 10_000


def test_bad_arguments_and_duplicate_names_are_refused():
    with pytest.raises(RuntimeError, match="alignment must be a power of two"):
        HostArena(4096, alignment=3000)
    with pytest.raises(RuntimeError, match="pin must be 'auto', 'cuda' or 'none'"):
        HostArena(4096, pin="yes")
    with pytest.raises(RuntimeError, match="capacity_bytes must be >= 1"):
        HostArena(0)
    arena = HostArena(MiB)
    arena.allocate("x", 4, torch.float32)
    with pytest.raises(RuntimeError, match="a view named 'x' exists already"):
        arena.allocate("x", 4, torch.float32)
    with pytest.raises(ValueError, match="negative dimension"):
        arena.allocate("y", (-1,), torch.float32)


def test_pin_cuda_without_a_device_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match=r"HostArena\(pin='cuda'\): (this build .* no CUDA support|no usable CUDA device)"):
        HostArena(MiB, pin="cuda")


def test_lock_locks_or_warns_with_the_reason():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arena = HostArena(4 * MiB, lock=True, pin="none")
    if not arena.locked:
        assert any("mlock of 4194304 bytes failed" in str(w.message) for w in caught)
    else:
        assert not caught


def test_views_read_as_zero_even_where_a_dropped_arena_was_written():
    """The store relies on it instead of zeroing its buffers (fresh pages, never handed out twice):
    a recycling allocator would fail here."""
    for round in range(3):
        arena = HostArena(16 * MiB, pin="none")
        views = [arena.allocate("a", (7,), torch.uint8), arena.allocate("b", (2 * MiB + 3,), torch.float32),
                 arena.allocate("c", (1023,), torch.float64)]
        for view in views:
            assert not view.any(), f"round {round}: a fresh view holds non-zero bytes"
            view.fill_(round + 1)  # dirty, then dropped: the next arena must not see these bytes
        del arena, views
        gc.collect()


def test_views_outlive_the_arena_and_feed_the_copy_engine():
    arena = HostArena(4 * MiB)
    a = arena.allocate("a", (MiB // 4,), torch.float32)
    b = arena.allocate("b", (MiB // 4,), torch.float32)
    del arena
    gc.collect()
    a.copy_(torch.randn(MiB // 4))
    with CopyEngine(threads=2, chunk_bytes=64 * 1024) as eng:
        eng.copy(b, a).wait()
    assert torch.equal(a, b)
