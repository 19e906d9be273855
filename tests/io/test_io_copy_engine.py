"""The copy engine: bytes identical for any size and offset, ordering per queue, dependencies,
keep-alive, GIL release, shutdown, bad inputs."""

import gc
import random
import threading
import time
import weakref

import pytest
import torch

from pystronghold.io import CopyEngine, CopyError, CopyHandle

MiB = 1 << 20


def random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


@pytest.fixture
def engine():
    with CopyEngine(threads=2, queues=4, chunk_bytes=1 * MiB) as eng:
        yield eng


def test_random_sizes_unaligned_offsets_bytes_identical(engine):
    rng = random.Random(1)
    source = random_bytes(64 * MiB + 4096)
    sizes = [1, 2, 7, 4095, 4097, MiB - 1, MiB + 3, 64 * MiB] + [int(2 ** rng.uniform(0, 26)) for _ in range(24)]
    jobs = []
    for i, size in enumerate(sizes):
        src_off = rng.randrange(0, source.numel() - size + 1)
        dst_off = rng.randrange(1, 4096)  # never page-aligned
        dst = torch.zeros(dst_off + size + 13, dtype=torch.uint8)
        h = engine.copy(dst[dst_off:dst_off + size], source[src_off:src_off + size], queue=i % engine.queues)
        jobs.append((h, dst, dst_off, src_off, size))
    for h, dst, dst_off, src_off, size in jobs:
        h.wait()
        assert h.done() and h.nbytes == size
        assert torch.equal(dst[dst_off:dst_off + size], source[src_off:src_off + size])
        assert not dst[:dst_off].any() and not dst[dst_off + size:].any()  # nothing outside written


@pytest.mark.parametrize("dtype_pair", [(torch.float32, torch.uint8), (torch.bfloat16, torch.int16), (torch.float64, torch.int32)])
def test_dtypes_may_differ_when_bytes_match(engine, dtype_pair):
    dst_dtype, src_dtype = dtype_pair
    src = random_bytes(4096 * 3).view(src_dtype)
    dst = torch.empty(4096 * 3 // torch.empty((), dtype=dst_dtype).element_size(), dtype=dst_dtype)
    engine.copy(dst, src).wait()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_many_small_concurrent_requests(engine):
    srcs = [random_bytes(random.randint(1, 5000)) for _ in range(2000)]
    dsts = [torch.empty_like(s) for s in srcs]
    handles = [engine.copy(d, s, queue=i % 4) for i, (d, s) in enumerate(zip(dsts, srcs))]
    for h in handles:
        h.wait()
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_one_queue_runs_in_order():
    with CopyEngine(threads=2, queues=2, chunk_bytes=64 * 1024) as eng:
        n = 16 * MiB
        a, b, c = random_bytes(n), torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        # a -> b, then b -> c on the same queue: c must see the finished b.
        h1 = eng.copy(b, a, queue=1)
        h2 = eng.copy(c, b, queue=1)
        # Overwrites of one buffer: the last one submitted wins.
        final = torch.empty(n, dtype=torch.uint8)
        patterns = [torch.full((n,), v, dtype=torch.uint8) for v in range(1, 6)]
        hs = [eng.copy(final, p, queue=0) for p in patterns]
        h2.wait()
        for h in hs:
            h.wait()
        assert torch.equal(c, a)
        assert torch.equal(final, patterns[-1])
        chain = [h1, h2]
        for earlier, later in [*zip(chain, chain[1:]), *zip(hs, hs[1:])]:
            assert earlier.end_s <= later.start_s <= later.end_s


def test_after_dependencies_across_queues():
    with CopyEngine(threads=2, queues=3, chunk_bytes=64 * 1024) as eng:
        n = 8 * MiB
        a = random_bytes(n)
        b, c, d = (torch.empty(n, dtype=torch.uint8) for _ in range(3))
        h1 = eng.copy(b, a, queue=0)
        h2 = eng.copy(c, b, queue=1, after=[h1])
        h3 = eng.copy(d, c, queue=2, after=[h2, h1])
        h3.wait()
        assert torch.equal(d, a)
        assert h1.end_s <= h2.start_s and h2.end_s <= h3.start_s
        # a finished handle is a valid dependency too
        e = torch.empty(n, dtype=torch.uint8)
        eng.copy(e, d, queue=0, after=[h3]).wait()
        assert torch.equal(e, a)


def test_timestamps_on_monotonic_clock(engine):
    before = time.monotonic()
    h = engine.copy(torch.empty(MiB, dtype=torch.uint8), random_bytes(MiB))
    h.wait()
    after = time.monotonic()
    assert before <= h.start_s <= h.end_s <= after


def test_request_keeps_tensors_alive_and_releases_them(engine):
    n = 32 * MiB
    src = random_bytes(n)
    expected = src.clone()
    dst = torch.empty(n, dtype=torch.uint8)
    ref = weakref.ref(src)
    h = engine.copy(dst, src)
    del src
    h.wait()
    gc.collect()
    assert ref() is None, "the request must drop its tensors once done"
    assert torch.equal(dst, expected)


def test_wait_timeout_then_success():
    with CopyEngine(threads=1, queues=1, chunk_bytes=4096) as eng:
        n = 128 * MiB  # 32768 chunks on one thread: far longer than the immediate wait below
        src, dst = random_bytes(n), torch.empty(n, dtype=torch.uint8)
        h = eng.copy(dst, src)
        with pytest.raises(TimeoutError, match="not done after 0.0 s"):
            h.wait(timeout_s=0.0)
        h.wait()
        assert torch.equal(dst, src)


def test_wait_releases_the_gil():
    with CopyEngine(threads=1, queues=1, chunk_bytes=4096) as eng:
        n = 128 * MiB
        src, dst = random_bytes(n), torch.empty(n, dtype=torch.uint8)
        h = eng.copy(dst, src)
        span = {}

        def waiter():
            span["enter"] = time.monotonic()
            h.wait()
            span["exit"] = time.monotonic()

        t = threading.Thread(target=waiter)
        stamps = []
        t.start()
        while t.is_alive():
            stamps.append(time.monotonic())
        t.join()
        assert any(span["enter"] < s < span["exit"] for s in stamps), "main thread never ran during wait()"


def test_closed_engine_refuses_new_work():
    eng = CopyEngine(threads=1, queues=1)
    h = eng.copy(torch.empty(10), torch.ones(10))
    eng.close()
    assert h.done() and eng.closed
    with pytest.raises(RuntimeError, match="CopyEngine is closed"):
        eng.copy(torch.empty(10), torch.ones(10))
    eng.close()  # idempotent


def test_close_without_wait_cancels_pending_requests():
    eng = CopyEngine(threads=1, queues=2, chunk_bytes=4096)
    n = 64 * MiB
    src = random_bytes(n)
    dsts = [torch.empty(n, dtype=torch.uint8) for _ in range(4)]
    handles = [eng.copy(d, src, queue=0) for d in dsts]
    dependent = eng.copy(torch.empty(n, dtype=torch.uint8), src, queue=1, after=[handles[-1]])
    eng.close(wait=False)
    assert all(h.done() for h in [*handles, dependent])
    with pytest.raises(CopyError, match="cancelled") as info:
        handles[-1].wait()
    assert info.value.errno != 0
    with pytest.raises(CopyError, match="cancelled"):
        dependent.wait()


def test_bad_inputs_are_refused_clearly(engine):
    with pytest.raises(RuntimeError, match="dst holds 40 bytes but src holds 44 bytes"):
        engine.copy(torch.empty(10), torch.empty(11))
    with pytest.raises(RuntimeError, match="src must be contiguous"):
        engine.copy(torch.empty(8), torch.empty(4, 4)[:, :2])
    x = torch.empty(100, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="overlap"):
        engine.copy(x[0:60], x[40:100])
    with pytest.raises(RuntimeError, match=r"queue must be in \[0, 3\], got 4"):
        engine.copy(torch.empty(1), torch.empty(1), queue=4)
    with pytest.raises(TypeError, match="expected CopyHandle"):
        engine.copy(torch.empty(1), torch.empty(1), after=["nope"])
    with CopyEngine(threads=1, queues=1) as other:
        foreign = other.copy(torch.empty(1), torch.empty(1))
        with pytest.raises(RuntimeError, match="another engine"):
            engine.copy(torch.empty(1), torch.empty(1), after=[foreign])
    with pytest.raises(RuntimeError, match="threads must be in"):
        CopyEngine(threads=0)
    with pytest.raises(RuntimeError, match="chunk_bytes must be >= 4096"):
        CopyEngine(chunk_bytes=100)


def test_zero_byte_copy_completes(engine):
    h = engine.copy(torch.empty(0), torch.empty(0, dtype=torch.int64))
    h.wait()
    assert h.done() and h.nbytes == 0 and isinstance(h, CopyHandle)
