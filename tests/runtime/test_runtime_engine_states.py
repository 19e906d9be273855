"""The engine's own state (``states.optimizer_state``) is read from and loaded into the parts that
hold it, the step's counters and the pass executor, without an engine around them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pystronghold.runtime.states.optimizer_state import (block_step_counts, engine_state_dict,
                                                         load_engine_state_dict)


def _stepper(steps=3, skipped=1, block_steps=(2,)):
    return SimpleNamespace(steps=steps, skipped_steps=skipped, block_steps=list(block_steps), scaler=None)


class _Executor:
    def __init__(self, micro_batches: int = 0) -> None:
        self.micro_batches, self.layer_drop, self.drained = micro_batches, SimpleNamespace(enabled=False), 0

    def in_pass(self) -> bool:
        return False

    def synchronize(self, updates: bool = True) -> None:
        self.drained += 1


def test_the_state_comes_from_the_steps_counters():
    """Three blocks, the last one streamed and skipped once by layer drop: the resident two are at
    the run's count."""
    state = engine_state_dict(_stepper(), SimpleNamespace(enabled=False), 3)
    assert state == {"steps": 3, "skipped_steps": 1, "block_steps": [3, 3, 2], "loss_scaler": None, "layer_drop": None}


def test_a_loaded_state_lands_in_the_steps_counters_after_a_drain():
    stepper, executor = _stepper(steps=0, skipped=0, block_steps=(0,)), _Executor()
    load_engine_state_dict(stepper, executor, 3, engine_state_dict(_stepper(), executor.layer_drop, 3))
    assert (stepper.steps, stepper.skipped_steps, stepper.block_steps, executor.drained) == (3, 1, [2], 1)
    assert block_step_counts(stepper, 3) == [3, 3, 2]


def test_a_state_loaded_mid_step_is_refused_before_anything_changes():
    stepper, executor = _stepper(steps=0, skipped=0, block_steps=(0,)), _Executor(micro_batches=1)
    with pytest.raises(RuntimeError, match="a step is in progress"):
        load_engine_state_dict(stepper, executor, 3, engine_state_dict(_stepper(), executor.layer_drop, 3))
    assert (stepper.steps, stepper.block_steps, executor.drained) == (0, [0], 0)
