"""`pystronghold train` places the head/tail and the saved block inputs by the planner: "auto" turns
--head-tail host and --offload-activations on only when the run would not fit the device budget
without them; where no budget is known the runtime's own rules decide."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pystronghold.cli import build_parser
from pystronghold.runtime.config import OFFLOAD_AUTO_FRACTION, RuntimeConfig, offload_in_effect
from pystronghold.train.command import config_from_args
from pystronghold.train.config import AutoWindowOptions
from pystronghold.train.loop import Trainer
from pystronghold.train.run import resolve
from train_helpers import tiny_config

# 32 narrow blocks at 2,048 tokens: their saved inputs (32 x 2048 x 64 x 4 B = 16 MiB) are most of
# what a device budget of ~20-30 MiB must hold, so the planner offloads them below it and not above
DEEP = {"vocab_size": 256, "seq_len": 2048, "layers": 32, "hidden": 64, "heads": 4}
# a 32K vocabulary: head and tail with their device AdamW (20 B a parameter) outweigh the rest
WIDE_VOCAB = {"vocab_size": 32768, "seq_len": 256, "layers": 2, "hidden": 64, "heads": 4}


def _config(tmp_path, model: dict, *argv: str):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(model))
    return config_from_args(build_parser().parse_args(
        ["train", "--model", str(path), "--seq", str(model["seq_len"]), "--batch", "1", *argv]))


def _chosen(config) -> dict:
    """The long-context settings the run of ``config`` decided (``Run.long_context``)."""
    return resolve(config).long_context


def _budgets(tmp_path, model, *argv, mib=range(4, 200, 4)):
    return {m: _chosen(_config(tmp_path, model, "--device-budget-mb", str(m), *argv))
            for m in mib}


def test_inputs_are_offloaded_exactly_below_the_budget_they_need(tmp_path):
    """Over a sweep of device budgets, the settings turned on never grow with the budget: nothing
    fits at first (the runtime's rules are left), then both, then a band where offloading the
    inputs alone fits, then both stay on the device."""
    got = _budgets(tmp_path, DEEP, mib=range(4, 60, 4))
    offload_only = [m for m, s in got.items() if s == {"head_tail_on_host": False, "offload_block_inputs": True}]
    kept = [m for m, s in got.items() if s == {"head_tail_on_host": False, "offload_block_inputs": False}]
    assert offload_only and kept and max(offload_only) < min(kept)
    turned_on = [sum(s.values()) if s else 3 for s in got.values()]  # {}: not even both fit
    assert turned_on == sorted(turned_on, reverse=True) and turned_on[0] == 3


def test_a_large_vocabulary_puts_head_and_tail_on_the_host_when_needed(tmp_path):
    got = _budgets(tmp_path, WIDE_VOCAB, mib=range(100, 200, 8))
    host = [m for m, s in got.items() if s == {"head_tail_on_host": True, "offload_block_inputs": False}]
    device = [m for m, s in got.items() if s == {"head_tail_on_host": False, "offload_block_inputs": False}]
    assert host and device and max(host) < min(device)


def test_what_the_user_fixed_is_kept(tmp_path):
    """--offload-activations off: only the head/tail is chosen; --head-tail device: only the
    offload; the relay schedule stages its own inputs, so auto offload is off
    without asking the planner."""
    budget = ("--device-budget-mb", "20")
    assert _chosen(_config(tmp_path, DEEP, *budget))["offload_block_inputs"] is True
    fixed = _chosen(_config(tmp_path, DEEP, *budget, "--offload-activations", "off"))
    assert set(fixed) <= {"head_tail_on_host"}
    fixed = _chosen(_config(tmp_path, DEEP, *budget, "--head-tail", "device"))
    assert set(fixed) == {"offload_block_inputs"}
    relay = _chosen(_config(tmp_path, DEEP, *budget, "--accumulation", "2",
                                                 "--schedule", "relay"))
    assert relay["offload_block_inputs"] is False


def test_without_a_device_budget_the_runtime_rules_decide(tmp_path):
    """On the CPU backend without --device-budget-mb the planner is not asked; the engine resolves
    "auto" offload to off there (its "device" is host memory) and to a quarter of a CUDA device."""
    config = _config(tmp_path, DEEP)
    assert _chosen(config) == {}
    rt = RuntimeConfig(offload_block_inputs="auto")
    assert offload_in_effect(rt, None) is False
    assert offload_in_effect(rt, 80 * 2**30) == int(OFFLOAD_AUTO_FRACTION * 80 * 2**30)
    assert offload_in_effect(dataclasses.replace(rt, checkpointing=False), 80 * 2**30) is False
    assert offload_in_effect(dataclasses.replace(rt, accumulation_steps=2, schedule="relay"), 80 * 2**30) is False
    assert offload_in_effect(dataclasses.replace(rt, offload_block_inputs=123), None) == 123


def _run(config):
    trainer = Trainer(resolve(config))
    try:
        result = trainer.train()
        return result, trainer.engine.config.offload_block_inputs, trainer.engine.stats()["saved_inputs"]
    finally:
        trainer.close()


@pytest.mark.slow
def test_train_offloads_by_the_plan_and_the_losses_are_the_kept_ones(tmp_path):
    """A run whose budget (20 MiB) needs the offload takes it by itself ("auto") and trains the losses
    of the run that keeps the inputs (bit for bit, fp32, clipping); with 80 MiB it keeps them."""
    base = tiny_config(tmp_path, steps=2, model=DEEP)
    base = dataclasses.replace(base, data=dataclasses.replace(base.data, batch=1, seq=DEEP["seq_len"],
                                                              val_fraction=0.25),
                               run=dataclasses.replace(base.run, eval_batches=1))

    def with_budget(mib, offload):
        return dataclasses.replace(base, auto_window=AutoWindowOptions(device_budget_mb=mib),
                                   runtime=dataclasses.replace(base.runtime, offload_block_inputs=offload,
                                                               head_tail_on_host="auto"))

    auto, in_effect, staged = _run(with_budget(20, "auto"))
    kept, kept_effect, none = _run(with_budget(20, False))
    roomy, roomy_effect, _ = _run(with_budget(80, "auto"))
    assert in_effect is True and staged["staged_bytes"] == DEEP["layers"] * DEEP["seq_len"] * DEEP["hidden"] * 4
    assert kept_effect is False and none is None and roomy_effect is False
    assert auto.losses == kept.losses == roomy.losses
