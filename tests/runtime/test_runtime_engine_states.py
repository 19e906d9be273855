"""The block states (``states.state_dict.EngineStates``) and the engine's own state
(``states.optimizer_state``) are read from and loaded into the parts that hold them (the resident
blocks, the step's counters, the pass executor), without an engine around them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pystronghold.runtime.states.optimizer_state import (block_step_counts, engine_state_dict,
                                                         load_engine_state_dict)
from pystronghold.runtime.states.state_dict import EngineStates


def _stepper(steps=3, skipped=1, block_steps=(2,)):
    return SimpleNamespace(steps=steps, skipped_steps=skipped, block_steps=list(block_steps), scaler=None)


class _Executor:
    def __init__(self, micro_batches: int = 0, in_pass: bool = False) -> None:
        self.micro_batches, self.layer_drop, self.drained = micro_batches, SimpleNamespace(enabled=False), 0
        self._in_pass = in_pass

    def in_pass(self) -> bool:
        return self._in_pass

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


def _resident_states(executor: _Executor) -> tuple[EngineStates, torch.nn.Parameter]:
    """One resident block of one parameter, ``blocks.0.w``, no head or tail."""
    w = torch.nn.Parameter(torch.arange(3.0))
    resident = SimpleNamespace(count=1, block_params=[[w]], read=lambda block, state: [w.detach()])
    return EngineStates([["blocks.0.w"]], [], store=None, window=None, resident=resident,
                        device_optimizer=SimpleNamespace(params=[]), head_tail_params=[], executor=executor), w


def test_block_states_read_a_resident_block_after_a_drain():
    executor = _Executor()
    states, w = _resident_states(executor)
    assert states.block_params(0) == [w] and states.block_shapes(0) == [(3,)]
    assert states.read_block(0, ("master",))["master"]["blocks.0.w"].tolist() == [0.0, 1.0, 2.0]
    assert executor.drained == 1


def test_block_states_refuse_a_write_during_a_pass():
    states, _ = _resident_states(_Executor(in_pass=True))
    with pytest.raises(RuntimeError, match="during a forward/backward pass"):
        states.writable()
