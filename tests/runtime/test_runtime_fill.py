"""Filling the store at wrap(): meta blocks materialized by parallel threads, arenas made in
chunks by a builder thread beside the fill. Whatever the threads and chunks, the store holds
exactly the eager model's initial values (bit for bit), and errors from either thread surface."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import pystronghold as ph
import pystronghold.runtime.memory.store as store_mod
from pystronghold.models import GPT, GPTConfig
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.prepare import INIT_BYTES_IN_FLIGHT, init_threads_for
from pystronghold.runtime.memory.store import BlockLayout, HostStore
from pystronghold.io import HostArena
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)

CFG = GPTConfig(vocab_size=97, seq_len=16, layers=6, hidden=32, heads=2)


def _store_values(engine) -> list[dict[str, torch.Tensor]]:
    """Every host state of every block, flat (gaps included)."""
    st = engine_parts_for_tests(engine)["store"]  # every state of every block, padding included
    return [{state: st.read_state(b, state).clone() for state in st.placement.states} for b in range(engine.n_blocks)]


def _wrapped(lazy: bool, precision: str = "fp32", **options):
    model = GPT(CFG, seed=3, materialize_blocks=not lazy)
    return ph.wrap(model, window=2, precision=precision, **options)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("threads, chunk_bytes", [(1, None), (3, None), (4, 20_000)])
def test_parallel_fill_gives_the_eager_models_store_bit_for_bit(monkeypatch, precision, threads, chunk_bytes):
    eager = _wrapped(False, precision)
    want = _store_values(eager)
    eager.close()
    if chunk_bytes is not None:  # many small arenas: each block's buffers in an arena of their own
        monkeypatch.setattr(store_mod, "DEFAULT_CHUNK_BYTES", chunk_bytes)
    engine = _wrapped(True, precision, init_threads=threads)
    try:
        assert engine.fill_times["threads"] == threads
        if chunk_bytes is not None:
            assert engine.memory_report().host_arenas == len(engine.placement.states) * CFG.layers
        got = _store_values(engine)
    finally:
        engine.close()
    for b, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for state in w:
            assert torch.equal(g[state], w[state]), (b, state)


def test_materialize_calls_really_run_in_parallel_and_out_of_order():
    """A user materialize run by 3 threads: blocks 0 and 1 meet at a barrier (a serial fill would
    time out there), later blocks finish in reverse order; the store is still the serial one's."""
    barrier = threading.Barrier(2, timeout=20)
    models = []

    def make(threads):
        model = GPT(CFG, seed=3, materialize_blocks=False)

        def materialize(i):
            if threads > 1 and i < 2:
                barrier.wait()
            time.sleep(0.02 * (CFG.layers - i) if threads > 1 else 0)
            return model.materialize_block_(i)

        models.append(model)
        return ph.wrap(model, window=2, materialize=materialize, init_threads=threads)

    serial = make(1)
    want = _store_values(serial)
    serial.close()
    engine = make(3)
    try:
        got = _store_values(engine)
    finally:
        engine.close()
    for g, w in zip(got, want):
        for state in w:
            assert torch.equal(g[state], w[state])


def test_a_failing_materialize_stops_every_thread():
    model = GPT(CFG, seed=3, materialize_blocks=False)

    def materialize(i):
        if i == 3:
            raise RuntimeError("block 3 cannot be built")
        return model.materialize_block_(i)

    with pytest.raises(RuntimeError, match="block 3 cannot be built"):
        ph.wrap(model, window=2, materialize=materialize, init_threads=3)
    names = [t.name for t in threading.enumerate()]
    assert not any(n.startswith(("pystronghold-init", "pystronghold-store-arenas")) for n in names), names


def test_a_failing_arena_is_raised_by_the_block_that_needs_it():
    layouts = [BlockLayout([("w", torch.nn.Parameter(torch.zeros(1000)))]) for _ in range(4)]
    made = []

    def factory(capacity):
        if len(made) == 5:
            raise MemoryError("no memory for chunk 5")
        made.append(capacity)
        return HostArena(capacity, pin="none")

    store = HostStore(layouts, torch.float32, factory, chunk_bytes=1, background=True)
    try:
        # fp32: master, exp_avg, exp_avg_sq, grad per block, one arena each; block 0's four come first
        with pytest.raises(MemoryError, match="no memory for chunk 5"):
            store.wait_built()  # returns once the builder has failed
        store.acquire(0, ["master"])  # built before the failure: still usable
        with pytest.raises(MemoryError, match="no memory for chunk 5"):
            store.acquire(1, ["grad"])
    finally:
        store.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_new_store_reads_as_zero_though_the_last_one_was_written(background):
    """The store does not zero its buffers: its arenas' fresh views are zero. Every state of every
    block (moments, gradients, gaps) must start at zero, also after a store was filled and dropped."""
    layouts = [BlockLayout([("w", torch.nn.Parameter(torch.zeros(1000))), ("b", torch.nn.Parameter(torch.zeros(7)))])
               for _ in range(3)]
    for round in range(3):
        store = HostStore(layouts, torch.bfloat16, lambda n: HostArena(n, pin="none"), chunk_bytes=5000,
                          background=background)
        try:
            store.wait_built()
            assert store.arena_count > len(store.placement.states)  # several chunks per state
            for state in store.placement.states:
                for b in range(len(layouts)):
                    flat = store.read_state(b, state)
                    assert flat.numel() == layouts[b].numel and not flat.any(), (round, state, b)
                    flat.fill_(round + 1)  # dirty: the next store must not see it
        finally:
            store.close()
        del store


def test_the_phases_are_logged(caplog):
    with caplog.at_level("INFO", logger="pystronghold.runtime.prepare"):
        engine = _wrapped(True, init_threads=2)
    engine.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("store ready in"))
    for word in ("init", "on 2 threads", "arenas", "chunks", "copy"):
        assert word in line, line
    t = engine.fill_times
    assert t["total"] >= t["copy"] and t["init"] > 0 and t["arenas"] > 0


def test_init_threads_default_and_memory_cap():
    cores = os.cpu_count() or 1
    assert init_threads_for(0, True, 1000) == cores
    assert init_threads_for(0, False, 1000) == 1  # a user materialize is serial unless asked
    assert init_threads_for(5, False, 1000) == 5
    block = INIT_BYTES_IN_FLIGHT // (2 * 4 * 3)  # three such blocks (fp32, counted twice) fit
    assert init_threads_for(16, True, block) == 3
    assert init_threads_for(16, True, 10 * INIT_BYTES_IN_FLIGHT) == 1
    assert init_threads_for(16, True, 1000, bytes_in_flight=2 * 4 * 1000 * 2) == 2  # a small host


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_init_threads_is_refused(bad):
    with pytest.raises(ValueError, match="RuntimeConfig.init_threads must be an int >= 0"):
        RuntimeConfig(init_threads=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_store_arenas_are_pinned_in_chunks_and_hold_the_eager_values(monkeypatch):
    """On CUDA the builder thread pins every chunk (cudaHostRegister); the values are the eager model's."""
    eager = _wrapped(False)
    want = _store_values(eager)
    eager.close()
    monkeypatch.setattr(store_mod, "DEFAULT_CHUNK_BYTES", 20_000)
    engine = _wrapped(True, device="cuda", init_threads=3)
    try:
        memory = engine.memory_report()
        assert memory.host_pinned and memory.host_arenas == 4 * CFG.layers
        got = _store_values(engine)
    finally:
        engine.close()
    for g, w in zip(got, want):
        for state in w:
            assert torch.equal(g[state], w[state])
