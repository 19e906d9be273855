"""``resolve(TrainConfig) -> Run``: the options are checked against each other without touching the
machine (no file read, no model config), with ConfigError only; what they name is read once, by
``resolve``, which decides the run before anything is built and never writes into the options."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from pystronghold.models.presets import param_count
from pystronghold.options import ConfigError
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.settings.parallel import ParallelOptions
from pystronghold.train import run as run_module
from pystronghold.train import resolve
from pystronghold.train.config import (AutoWindowOptions, CheckpointOptions, DataOptions, ModelOptions, OptimOptions,
                                       RunOptions, TrainConfig)
from train_helpers import TINY, tiny_config


def test_the_options_are_built_without_reading_what_they_name(tmp_path):
    """A missing model file and data file are the run's to refuse, not the options'."""
    config = TrainConfig(model=ModelOptions(model=str(tmp_path / "missing.json")),
                         data=DataOptions(data=[str(tmp_path / "missing.txt")]))
    with pytest.raises(ValueError, match="^--model: cannot read .*missing.json"):
        resolve(config)
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    config.model = ModelOptions(model=str(model))
    with pytest.raises(ConfigError) as refused:
        resolve(config)
    assert refused.value.on_command_line() == f"--data: no such file or directory: {tmp_path / 'missing.txt'}"


@pytest.mark.parametrize("make, cli", [
    (lambda: DataOptions(max_bytes=10), "--max-bytes must be >= 1024, got 10"),
    (lambda: DataOptions(val_fraction=1.0), "--val-fraction must be in (0, 1), got 1.0"),
    (lambda: DataOptions(batch=0), "--batch must be >= 1, got 0"),
    (lambda: OptimOptions(lr=-1.0), "--lr must be > 0 and finite, got -1.0"),
    (lambda: OptimOptions(beta2=1.0), "--beta2 must be in [0, 1), got 1.0"),
    (lambda: AutoWindowOptions(device_budget_mb=-1.0), "--device-budget-mb must be >= 0 and finite, got -1.0"),
    (lambda: RunOptions(log_every=0), "--log-every must be >= 1, got 0"),
    (lambda: RunOptions(eval_every=-1), "--eval-every must be >= 0, got -1"),
    (lambda: CheckpointOptions(keep=0), "--keep must be >= 1, got 0"),
    (lambda: CheckpointOptions(resume=True), "--resume needs --checkpoint-dir"),
    (lambda: CheckpointOptions(checkpoint_dir="ck", resume=True, overwrite=True),
     "--overwrite starts a fresh run, --resume continues one: give one of them"),
    (lambda: TrainConfig(data=DataOptions(batch=3), parallel=ParallelOptions(dp_split=(2, 2))),
     "--dp-split 2,2 gives 2 replicas' samples, but there are --dp 1"),
])
def test_every_refusal_of_the_options_is_a_config_error(make, cli):
    with pytest.raises(ConfigError) as refused:
        make()
    assert refused.value.on_command_line() == cli


def test_the_run_holds_what_was_decided_and_the_options_stay_as_given(tmp_path):
    config = tiny_config(tmp_path)
    given = copy.deepcopy(config)
    run = resolve(config)
    assert (run.seq, run.lr, run.local_batch, run.model.layers) == (32, 3e-3, 4, TINY["layers"])
    assert run.seq_why is None and not run.hf and run.runtime.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seq = 16
    assert config == given


def test_under_torchrun_cuda_is_this_process_s_gpu_in_the_run_not_in_the_options(monkeypatch, tmp_path):
    """The device the Trainer used to write into its validated options is the Run's."""
    monkeypatch.setattr(RuntimeConfig, "check_device_present", lambda self: None)  # no GPU here
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    config = tiny_config(tmp_path)
    config.runtime = dataclasses.replace(config.runtime, device="cuda")
    config.parallel = ParallelOptions(dp=2)
    run = resolve(config)
    assert run.runtime.device == "cuda:1" and config.runtime.device == "cuda"


def test_the_host_store_refusal_counts_the_layout_s_bytes_per_parameter(tmp_path, monkeypatch):
    """The store needs the layout's host bytes per parameter (``runtime.memory.layout.host_bytes_per_param``),
    not a number of its own: a host one byte short of them refuses, and a layout that needed fewer
    would be let through."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps(TINY))
    config = TrainConfig(model=ModelOptions(model=str(model)), data=DataOptions(batch=1, seq=8))
    params = param_count(resolve(config).model)
    monkeypatch.setattr(run_module, "available_host_bytes", lambda: 16 * params - 1)
    with pytest.raises(MemoryError, match="parameters need about"):
        resolve(config)
    monkeypatch.setattr(run_module, "host_bytes_per_param", lambda dtype: 8)
    assert resolve(config).model.layers == TINY["layers"]


def test_the_model_is_checked_against_the_layout_before_it_takes_tp(monkeypatch):
    """--tp 3 on a model of 4 heads is the layout's one line, not the GPTConfig's refusal of tp_size."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = TrainConfig(model=ModelOptions(model="tiny"), data=DataOptions(batch=3), parallel=ParallelOptions(tp=3))
    with pytest.raises(ConfigError) as refused:
        resolve(config)
    assert refused.value.on_command_line() == "--tp 3 must divide the model's 4 attention heads"
