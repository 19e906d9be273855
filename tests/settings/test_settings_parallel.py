"""The parallel layout's settings, declared once (``settings.parallel``): every command and layer
uses the one ``ParallelOptions``, and pp x tp x dp is checked against the launch's processes in one
place (``ParallelOptions.check_world``), naming the fields in Python and the flags on the command
line."""

from __future__ import annotations

import pytest

from pystronghold.options import ConfigError
from pystronghold.settings.finetune import FinetuneOptions, LoraSpec
from pystronghold.settings.parallel import ParallelOptions


@pytest.mark.parametrize("world, options, python, cli", [
    (1, dict(tp=2), "ParallelOptions.tp=2 x dp=1 needs 2 processes; launch with torchrun --nproc-per-node 2",
     "--tp 2 x --dp 1 needs 2 processes; launch with torchrun --nproc-per-node 2 -m pystronghold train ..."),
    (3, dict(tp=2), "ParallelOptions.tp=2 must divide the number of processes 3",
     "--tp 2 must divide the number of processes 3"),
    (4, dict(tp=2, dp=1), "ParallelOptions.tp=2 x dp=1 = 2 processes, but there are 4",
     "--tp 2 x --dp 1 = 2 processes, but there are 4"),
    (3, dict(pp=2), "ParallelOptions.pp=2 x tp=1 x 1 data-parallel replicas = 2 processes, but there are 3",
     "--pp 2 x --tp 1 x 1 data-parallel replicas = 2 processes, but there are 3"),
], ids=["one-process", "tp-not-dividing", "sizes-not-the-world", "pipeline"])
def test_the_world_check_names_the_sizes(monkeypatch, world, options, python, cli):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as refused:
        ParallelOptions(**options).check_world()
    assert str(refused.value).startswith(python)
    assert refused.value.on_command_line() == cli


def test_a_layout_that_fills_the_world_passes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    ParallelOptions(tp=2, pp=2).check_world()  # dp 0: the world's rest, 2
    ParallelOptions(tp=2, dp=4).check_world()


@pytest.mark.parametrize("options, cli", [
    (dict(tp=0), "--tp must be >= 1, got 0"),
    (dict(dp=-1), "--dp must be >= 1 (or 0: world size / (--tp x --pp)), got -1"),
    (dict(dp_split=(4, 0)), "--dp-split must be positive sample counts, got (4, 0)"),
    (dict(dist_timeout=0.0), "--dist-timeout must be > 0, got 0.0"),
])
def test_bad_sizes_are_config_errors_naming_the_flag(options, cli):
    with pytest.raises(ConfigError) as refused:
        ParallelOptions(**options)
    assert refused.value.on_command_line() == cli


def test_each_shared_setting_has_one_class_wherever_it_is_used():
    """train and plan compose the same components; the planner, the pipeline runtime and LoRA use
    them as they are (no copy, no re-export from a higher floor)."""
    import pystronghold.models.lora as lora
    import pystronghold.pipelining.gpt as pipelining_gpt
    import pystronghold.planner.cost as cost
    from pystronghold.planner.command import PlanRequest
    from pystronghold.train.config import TrainConfig

    for job in (TrainConfig, PlanRequest):
        fields = {f.name: f.type for f in job.__dataclass_fields__.values()}
        assert fields["parallel"] in ("ParallelOptions", ParallelOptions)
        assert fields["finetune"] in ("FinetuneOptions", FinetuneOptions)
    assert type(TrainConfig().parallel) is ParallelOptions and type(TrainConfig().finetune) is FinetuneOptions
    assert pipelining_gpt.ParallelOptions is ParallelOptions and cost.FinetuneOptions is FinetuneOptions
    assert lora.LoraSpec is LoraSpec
    assert FinetuneOptions(lora_rank=4).lora == LoraSpec(rank=4, alpha=8.0)
