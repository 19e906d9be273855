"""``WindowOptimizer`` runs what its ``WindowSteps`` (the engine) runs: step, zero_grad and the state
dict, each method looked up when it is called, so a method replaced after the optimizer was made runs."""

from __future__ import annotations

import torch

from pystronghold.optim.hyper import AdamW
from pystronghold.optim.window_optimizer import WindowOptimizer


class _Steps:
    """A ``WindowSteps`` that records what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run_step(self) -> None:
        self.calls.append("step")

    def forget_grads(self) -> None:
        self.calls.append("zero_grad")

    def optimizer_state_dict(self) -> dict:
        self.calls.append("state_dict")
        return {"state": {}, "param_groups": []}

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self.calls.append(f"load {sorted(state_dict)}")


def test_the_optimizer_runs_its_steps_object():
    steps = _Steps()
    optimizer = WindowOptimizer([torch.nn.Parameter(torch.zeros(2, 3))], AdamW(lr=0.5), steps=steps)
    assert optimizer.step(closure=lambda: 1.5) == 1.5
    optimizer.zero_grad()
    assert optimizer.state_dict() == {"state": {}, "param_groups": []}
    optimizer.load_state_dict({"state": {}, "param_groups": []})
    assert steps.calls == ["step", "zero_grad", "state_dict", "load ['param_groups', 'state']"]
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_a_method_replaced_after_the_optimizer_was_made_is_the_one_run():
    steps = _Steps()
    optimizer = WindowOptimizer([torch.nn.Parameter(torch.zeros(3))], AdamW(), steps=steps)
    steps.run_step = lambda: steps.calls.append("wrapped step")
    optimizer.step()
    assert steps.calls == ["wrapped step"]
