"""A log point waits for the device and the copies, not for the host updates: with clipping the
host AdamW of a step's streamed blocks runs on behind the next step's forward at every log interval,
and the losses are those of a run that logs rarely."""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import replace

import pytest

from pystronghold.train.loop import Trainer
from pystronghold.train.run import resolve
from runtime_models import one_torch_thread
from train_helpers import run_training, tiny_config

_threads = pytest.fixture(autouse=True)(one_torch_thread)

GATE_S = 60.0
"""How long the gated update waits for the next forward: only a run that drains at the log (the
next forward cannot start) waits that long, and then fails."""


def _log_every(config, n: int, **run):
    return replace(config, run=replace(config.run, log_every=n, **run))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_losses_are_bit_identical_whether_every_step_logs_or_every_tenth(tmp_path, precision):
    config = tiny_config(tmp_path, steps=10, clip=1.0, precision=precision)
    often = run_training(_log_every(config, 1, eval_every=4))
    rarely = run_training(_log_every(config, 10))
    assert len(often.intervals) == 10 and len(rarely.intervals) == 1
    assert often.losses == rarely.losses


def _intersect(a, b) -> bool:
    return max(a["ts"], b["ts"]) < min(a["ts"] + a["dur"], b["ts"] + b["dur"])


def test_host_updates_overlap_the_next_forward_at_every_log(tmp_path):
    """``--log-every 1 --clip 1``: the update of the last streamed block of step 1 is held (inside
    its optimizer span) until block 0 of step 2 computes its forward. Drained at the log, the
    forward could not start first; without the drain the two spans intersect."""
    config = _log_every(tiny_config(tmp_path, steps=3, clip=1.0, trace=str(tmp_path / "trace")), 1)
    trainer = Trainer(resolve(config))
    tracer, last = trainer.engine.trace, trainer.engine.n_streamed - 1
    forward_began, held = threading.Event(), []
    real_span = tracer.span

    @contextlib.contextmanager
    def held_span(kind, block=None, *args, **kwargs):
        with real_span(kind, block, *args, **kwargs):
            if kind == "optimizer" and block == last and not held:
                held.append(forward_began.wait(GATE_S))
            yield

    def block_0_computes(module, args):
        if trainer.step == 1:  # step 2's forward
            forward_began.set()

    tracer.span = held_span
    first_layer = next(iter(trainer.model.blocks[0].children()))
    hook = first_layer.register_forward_pre_hook(block_0_computes)
    try:
        trainer.train()
    finally:
        hook.remove()
        trainer.close()
    assert held == [True], "the held update never saw step 2's forward begin"
    events = [e for e in json.loads((tmp_path / "trace" / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]
    updates = [e for e in events if e["cat"] == "optimizer" and e["args"]["block"] == last]
    forwards = [e for e in events if e["cat"] == "compute_fwd" and e["args"]["block"] == 0]
    assert len(updates) == 3 and len(forwards) == 3
    assert _intersect(updates[0], forwards[1])
    # and no span of an update that ended between a log and the next step is lost
    assert len([e for e in events if e["cat"] == "optimizer"]) == 3 * trainer.engine.n_streamed
