"""Input offload (runtime/streaming/saved_inputs.py, ``offload_block_inputs``): each recomputed block's saved
input goes to host memory after its forward and comes back one block ahead of its backward. The
results are bit-identical to keeping the inputs; the staged bytes are the block inputs; the copies
run while later blocks compute (shown from the trace's intervals, with copies held by gates that
only the later block's compute opens: no timing involved)."""

from __future__ import annotations

import copy
import queue as queue_lib
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pystronghold as ph
from pystronghold.options import ConfigError
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.engine import engine_parts_for_tests
from runtime_models import HYPER, gpt_batches, one_torch_thread, tiny_gpt

_threads = pytest.fixture(autouse=True)(one_torch_thread)

BLOCKS = 4
STEPS = 3
ACCUMULATION = 2
ITEMSIZE = {"fp32": 4, "bf16": 2}


# ---- models


class _Block(nn.Module):
    """x + tanh(fc(x)); tells ``notes(index, recompute)`` when its compute begins."""

    def __init__(self, d: int, index: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.index = index
        self.notes = None
        self.fail = False

    def forward(self, x):
        if self.notes is not None:
            self.notes(self.index, torch.is_grad_enabled())  # grad on: the backward's recompute
        if self.fail:
            raise KeyError(f"block {self.index} failed")
        return x + torch.tanh(self.fc(x))


class _Stack(nn.Module):
    """head -> blocks -> tail; ``reads_inputs_after``: each block's input is read again after the
    block (a residual written between blocks, a tail over every block's input), so the model keeps
    references to the inputs the engine offloads."""

    def __init__(self, d: int = 32, reads_inputs_after: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(6, d)
        self.blocks = nn.ModuleList(_Block(d, i) for i in range(BLOCKS))
        self.tail = nn.Linear(d, 2)
        self.reads_inputs_after = reads_inputs_after

    def forward(self, x, y):
        h = self.head(x)
        kept = []
        for block in self.blocks:
            if self.reads_inputs_after:
                kept.append(h)
                h = 0.5 * h + block(h)
            else:
                h = block(h)
        out = torch.stack(kept + [h]).mean(0) if kept else h
        return F.mse_loss(self.tail(out), y)


def _stack_batches(n: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, 6, generator=g), torch.randn(2, 8, 2, generator=g)) for _ in range(n)]


def _llama():
    from hf_small import hf_llama

    return hf_llama()


# ---- training


def _train(model, batches, *, accumulation=ACCUMULATION, window=2, loss_of=lambda e, b: e(*b), engine_hook=None,
           **options):
    """STEPS optimizer steps of ``accumulation`` micro-batches. Returns (losses, fp32 parameters,
    stats()["saved_inputs"], trace events); ``engine_hook(engine)`` runs before the first."""
    if "blocks" not in options:
        options["blocks"] = model.blocks
    engine = ph.wrap(model, optimizer=ph.AdamW(**HYPER, bitwise_torch=True), window=window,
                     accumulation_steps=accumulation, trace=True, **options)
    if engine_hook is not None:
        engine_hook(engine)
    try:
        losses = []
        for k, batch in enumerate(batches):
            loss = loss_of(engine, batch)
            engine.backward(loss / accumulation)
            losses.append(loss.detach())
            if (k + 1) % accumulation == 0:
                engine.step()
                engine.zero_grad()
        engine.synchronize()
        assert engine.in_flight() == 0
        params = {k: v.clone() for k, v in engine.master_parameters().items()}
        return torch.stack(losses), params, engine.stats()["saved_inputs"], engine.trace.events()
    finally:
        engine.close()


def _assert_bit_identical(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _hf_loss(engine, x):
    return engine(input_ids=x, labels=x).loss


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_offloaded_inputs_train_bit_identical_to_kept_ones(kind, precision):
    """Offload all, or beyond a budget of two blocks' inputs: the losses and final weights of
    STEPS steps (accumulation, clipping) are bit for bit those with every input on the device, and
    the staged bytes are exactly the offloaded blocks' inputs (B x T x H in the compute dtype)."""
    if kind == "gpt":
        make, batches, loss_of = lambda: tiny_gpt(BLOCKS), gpt_batches(STEPS * ACCUMULATION), lambda e, b: e(*b)
        per_block = 2 * 32 * 64 * ITEMSIZE[precision]  # (B, T, H) hidden states
        blocks = {}
    else:
        pytest.importorskip("transformers")
        from hf_small import token_batches

        make, batches, loss_of = _llama, token_batches(STEPS * ACCUMULATION), _hf_loss
        per_block = 2 * 16 * 64 * ITEMSIZE[precision]
        blocks = {"blocks": None}  # wrap finds them
    model = make()
    options = dict(precision=precision, clip_grad_norm=0.5, loss_of=loss_of, strict=True, **blocks)
    kept = _train(copy.deepcopy(model), batches, **options)
    assert kept[2] is None  # no offload: nothing managed
    offloaded = _train(copy.deepcopy(model), batches, offload_block_inputs=True, **options)
    _assert_bit_identical(offloaded, kept)
    assert offloaded[2]["staged_bytes"] == BLOCKS * per_block
    # what stays on the device whatever the budget: inputs made without a graph (Llama's rotary
    # cos/sin, position ids), counted once; GPT's blocks take the hidden states only
    shared = offloaded[2]["device_bytes"]
    assert (shared == 0) == (kind == "gpt")
    budget = _train(model, batches, offload_block_inputs=shared + 2 * per_block, **options)
    _assert_bit_identical(budget, kept)
    assert budget[2] == dict(device_bytes=shared + 2 * per_block, staged_bytes=(BLOCKS - 2) * per_block, disk_bytes=0)
    # one copy out and one back per offloaded input and micro-batch
    for run, n in ((offloaded, BLOCKS), (budget, BLOCKS - 2)):
        for kind_ in ("act_d2h", "act_h2d"):
            copies = [e for e in run[3] if e.kind == kind_]
            assert len(copies) == n * STEPS * ACCUMULATION and {e.nbytes for e in copies} == {per_block}
    assert not [e for e in kept[3] if e.kind.startswith("act_")]


@pytest.mark.parametrize("host_blocks", [0, 2])
def test_inputs_past_host_memory_go_to_disk_and_train_bit_identically(tmp_path, host_blocks):
    """With ``nvme_dir``, staged inputs beyond the host budget (none, or two blocks' worth) are
    written to a file under it and read back ahead of their recompute: bit for bit the run that
    keeps every input on the device (strict mode: a read-back that did not land is NaN); every
    byte written is read back once; the file goes with the engine."""
    model, batches = tiny_gpt(BLOCKS), gpt_batches(STEPS * ACCUMULATION)
    per_block = 2 * 32 * 64 * 4
    options = dict(clip_grad_norm=0.5, strict=True)
    kept = _train(copy.deepcopy(model), batches, **options)
    spills = []

    def host_budget(engine):
        spill = engine_parts_for_tests(engine)["executor"].input_spill
        spill.host_budget_bytes = host_blocks * per_block
        spills.append(spill)

    on_disk = (BLOCKS - host_blocks) * per_block
    passes = []

    def forward_then_settle(engine, batch):
        """The forward, then (before backward) its writes waited for and their host buffers given
        up, so that backward reads every one back from the file."""
        loss = engine(*batch)
        passes.append(1)
        inputs = engine_parts_for_tests(engine)["executor"].saved_inputs
        inputs.free_copied(wait=True)  # every copy-out done: every write queued
        deadline = time.monotonic() + 60
        while spills[0].written_bytes < len(passes) * on_disk and time.monotonic() < deadline:
            time.sleep(0.001)
        inputs.free_copied(wait=True)  # the written ones give their host memory up
        return loss

    spilled = _train(model, batches, offload_block_inputs=True, nvme_dir=str(tmp_path), engine_hook=host_budget,
                     loss_of=forward_then_settle, **options)
    _assert_bit_identical(spilled, kept)
    assert spilled[2] == dict(device_bytes=0, staged_bytes=BLOCKS * per_block, disk_bytes=on_disk)
    assert spills[0].written_bytes == spills[0].read_bytes == len(passes) * on_disk
    assert not list(tmp_path.glob("pystronghold-inputs-*"))


def test_a_model_that_reads_block_inputs_after_the_block_stays_exact():
    """The engine gives up an offloaded input's device memory by dropping its own reference only:
    a model that still holds the input (a residual after the block, a tail over every input) reads
    it intact."""
    model = _Stack(reads_inputs_after=True)
    batches = _stack_batches(STEPS * ACCUMULATION)
    kept = _train(copy.deepcopy(model), batches)
    offloaded = _train(model, batches, offload_block_inputs=True, strict=True)
    _assert_bit_identical(offloaded, kept)
    assert offloaded[2]["staged_bytes"] == BLOCKS * 2 * 8 * 32 * 4


@pytest.mark.parametrize("options", [dict(layer_drop=0.5, layer_drop_seed=3), dict(resident_blocks=1),
                                     dict(overlap="none", window=1)],
                         ids=["layer-drop", "resident", "overlap-none-W1"])
def test_offload_with_layer_drop_resident_blocks_and_one_slot(options):
    """Skipped blocks stage nothing; a resident block keeps its graph (its input is not staged);
    one slot: all bit-identical to keeping the inputs."""
    model = _Stack()
    batches = _stack_batches(STEPS * ACCUMULATION)
    kept = _train(copy.deepcopy(model), batches, **options)
    offloaded = _train(model, batches, offload_block_inputs=True, **options)
    _assert_bit_identical(offloaded, kept)
    per_block = 2 * 8 * 32 * 4
    staged = [e for e in offloaded[3] if e.kind == "act_d2h"]
    assert {e.nbytes for e in staged} == {per_block}
    if "resident_blocks" in options:
        assert offloaded[2]["staged_bytes"] == (BLOCKS - 1) * per_block
        assert len(staged) == STEPS * ACCUMULATION * (BLOCKS - 1)
    elif "layer_drop" in options:  # the blocks that ran: fewer than all of them in some steps
        assert BLOCKS // 2 * STEPS * ACCUMULATION <= len(staged) < STEPS * ACCUMULATION * BLOCKS
    else:
        assert len(staged) == STEPS * ACCUMULATION * BLOCKS


def test_an_abandoned_pass_leaves_nothing_and_the_next_one_is_exact():
    """A block raises in the middle of a training forward: the inputs staged so far are dropped
    when the next pass begins (every copy waited for), and training goes on as if the failed
    forward had not run."""
    model = _Stack()
    batches = _stack_batches(STEPS * ACCUMULATION)
    kept = _train(copy.deepcopy(model), batches)

    failed = False

    def fail_once(engine, batch):
        nonlocal failed
        executor = engine_parts_for_tests(engine)["executor"]
        if not failed:
            failed = True
            engine.model.blocks[2].fail = True
            try:
                with pytest.raises(KeyError, match="block 2 failed"):
                    engine(*batch)
                assert executor.saved_inputs.pending() == [1, 2]  # blocks 0 and 1
            finally:
                engine.model.blocks[2].fail = False
        loss = engine(*batch)
        assert executor.saved_inputs.pending() == [1, 2, 3, 4]  # a new pass: the failed one's dropped
        return loss

    offloaded = _train(model, batches, offload_block_inputs=True, loss_of=fail_once)
    _assert_bit_identical(offloaded, kept)


def test_eval_and_no_grad_forwards_stage_nothing():
    model = _Stack()
    x, y = _stack_batches(1)[0]
    engine = ph.wrap(model, blocks=model.blocks, window=2, offload_block_inputs=True, trace=True)
    try:
        executor = engine_parts_for_tests(engine)["executor"]
        with torch.no_grad():
            engine(x, y)
            assert executor.saved_inputs is None
        engine.eval()
        with torch.no_grad():
            engine(x, y)
        engine.synchronize()
        assert engine.stats()["saved_inputs"] is None
        assert not [e for e in engine.trace.events() if e.kind.startswith("act_")]
        engine.train()
        engine.backward(engine(x, y))
        assert engine.stats()["saved_inputs"] == dict(device_bytes=0, staged_bytes=BLOCKS * 2 * 8 * 32 * 4,
                                                      disk_bytes=0)
    finally:
        engine.close()


def test_bad_offload_settings_are_refused():
    with pytest.raises(ConfigError, match="RuntimeConfig.offload_block_inputs must be True, False, 'auto' or an int"):
        RuntimeConfig(offload_block_inputs=-1)
    with pytest.raises(ConfigError, match="RuntimeConfig.offload_block_inputs must be True, False, 'auto' or an int"):
        RuntimeConfig(offload_block_inputs="on")
    with pytest.raises(ConfigError, match="offload_block_inputs needs checkpointing"):
        RuntimeConfig(offload_block_inputs=True, checkpointing=False)
    with pytest.raises(ConfigError, match="relay schedule stages saved block inputs beyond relay_activation_bytes"):
        RuntimeConfig(offload_block_inputs=True, schedule="auto", accumulation_steps=2)
    assert RuntimeConfig(offload_block_inputs=True, schedule="auto").offload_block_inputs is True


# ---- order and overlap, from the trace


class _GatedCopies:
    """Test double of the CPU backend's copy engine (``backend.copies``) that holds saved-input
    copies until a gate opens. Queues 0 (loads) and 1 (copy-outs) each get one worker that runs
    its requests in order, each moved by the wrapped engine; the other queues pass through. A
    saved-input copy is the only one with uint8 on both sides (weights and gradients are float),
    and ``gate(direction, n)`` gives the event the n-th one of a direction ("act_d2h", "act_h2d")
    waits for (None: not held). Handles stamp ``start_s`` when the copy is *issued* and ``end_s``
    when it is done: the interval the copy is in flight. A gate that stays shut ``TIMEOUT_S`` lets
    its copy go and counts in ``stuck`` (the engine waited for a copy it should not have)."""

    TIMEOUT_S = 60.0

    def __init__(self, inner, gate) -> None:
        self.inner, self.gate = inner, gate
        self.stuck: list[tuple[str, int]] = []
        self._count = {"act_d2h": 0, "act_h2d": 0}
        self._work = {q: queue_lib.SimpleQueue() for q in (0, 1)}
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self._work.values()]
        for t in self._threads:
            t.start()

    def copy(self, dst, src, *, queue=0, after=()):
        if queue not in self._work:
            return self.inner.copy(dst, src, queue=queue, after=after)
        handle = _Handle(dst.numel() * dst.element_size(), queue)
        gate = None
        if dst.dtype == torch.uint8 and src.dtype == torch.uint8:
            direction = "act_d2h" if queue == 1 else "act_h2d"
            gate = (direction, self._count[direction], self.gate(direction, self._count[direction]))
            self._count[direction] += 1
        self._work[queue].put((handle, dst, src, list(after), gate))
        return handle

    def _serve(self, work) -> None:
        while (item := work.get()) is not None:
            handle, dst, src, after, gate = item
            try:
                for h in after:
                    h.wait()
                if gate is not None and gate[2] is not None and not gate[2].wait(self.TIMEOUT_S):
                    self.stuck.append(gate[:2])
                self.inner.copy(dst, src, queue=handle.queue).wait()
            except BaseException as e:  # handed to whoever waits
                handle.error = e
            handle.end_s = time.monotonic()
            handle.finished.set()

    def close(self, wait: bool = True) -> None:
        for work in self._work.values():
            work.put(None)
        for t in self._threads:
            t.join()
        self.inner.close(wait)


class _Handle:
    def __init__(self, nbytes: int, queue: int) -> None:
        self.nbytes, self.queue = nbytes, queue
        self.start_s, self.end_s = time.monotonic(), 0.0
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def wait(self, timeout_s=None) -> None:
        self.finished.wait(timeout_s)
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self.finished.is_set()


def _gated_engine(model, gate, **options):
    engine = ph.wrap(model, blocks=model.blocks, window=2, offload_block_inputs=True, trace=True, **options)
    engine.backend.copies = _GatedCopies(engine.backend.copies, gate)
    return engine


def test_each_input_offload_runs_while_the_next_block_computes_and_comes_back_one_block_ahead():
    """Block b's input leaves while block b+1 computes (its copy is held until block b+1's forward
    has begun: an engine that waited for it there would never get there); in backward, block b's
    input is brought back while block b+1 recomputes (held until that recompute has begun). The
    trace's intervals show both, and that each copy was issued in time."""
    model = _Stack()
    begun = {(b, r): threading.Event() for b in range(BLOCKS) for r in (False, True)}
    for block in model.blocks:
        block.notes = lambda index, recompute: begun[index, recompute].set()

    def gate(direction, n):
        if direction == "act_d2h":  # issued in forward order: block n, held until block n+1 computes
            return begun[n + 1, False] if n + 1 < BLOCKS else None
        b = BLOCKS - 1 - n  # brought back in backward order, block b held until block b+1 recomputes
        return begun[b + 1, True] if b + 1 < BLOCKS else None

    engine = _gated_engine(model, gate)
    x, y = _stack_batches(1)[0]
    try:
        engine.backward(engine(x, y))
        engine.step()
        engine.synchronize()
        events = engine.trace.events()
        stuck = engine.backend.copies.stuck
    finally:
        engine.close()
    assert not stuck, f"the engine waited for these copies before the compute that opens their gate: {stuck}"
    one = {(e.kind, e.block): e for e in events}
    for kind in ("act_d2h", "act_h2d", "compute_fwd", "recompute", "compute_bwd"):
        assert sorted(e.block for e in events if e.kind == kind) == list(range(BLOCKS)), kind
    for b in range(BLOCKS - 1):
        out, nxt = one["act_d2h", b], one["compute_fwd", b + 1]
        assert one["compute_fwd", b].end_s <= out.start_s < nxt.start_s < out.end_s, b  # in flight behind b+1
        back, recompute, bwd = one["act_h2d", b], one["recompute", b + 1], one["compute_bwd", b + 1]
        assert back.start_s < recompute.start_s < back.end_s, b  # prefetched: behind block b+1's recompute
        assert back.start_s < bwd.end_s and back.end_s <= one["recompute", b].start_s, b


def test_strict_mode_catches_compute_that_does_not_wait_for_a_restored_input():
    """With the wait for the copy back removed (a test hook), the recompute reads the restored
    storage before its bytes land (held here until the end): strict mode NaN-filled it, and the
    recompute's checksum check names the block."""
    model = _Stack()
    release = threading.Event()
    engine = _gated_engine(model, lambda direction, n: release if direction == "act_h2d" else None, strict=True)
    engine_parts_for_tests(engine)["executor"].test_skip_waits.add("restore")
    x, y = _stack_batches(1)[0]
    try:
        with pytest.raises(RuntimeError, match=f"strict: block {BLOCKS - 1}'s recomputed output 0 differs"):
            engine.backward(engine(x, y))
    finally:
        release.set()
        engine.close()
