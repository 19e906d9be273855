"""`pystronghold train`'s runtime options are RuntimeConfig's fields (composed as TrainConfig.runtime),
generated from them with the flags, defaults and help the train CLI had before; a bad value is one
line naming the flag on the command line and the field in Python."""

from __future__ import annotations

import re

import pytest

from pystronghold.cli import build_parser, main
from pystronghold.options import ConfigError
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.train.command import config_from_args

# Every option `pystronghold train` had before the runtime settings moved into RuntimeConfig, and the
# relay schedule's and layer drop's, the interleaved pipeline's --pp-chunks, and the fine-tuning
# options.
TRAIN_FLAGS = ("--model --data --max-bytes --val-fraction --batch --seq --loss-chunk --mlp-tile --token-dtype --lr "
               "--warmup --min-lr-ratio --weight-decay --decay --beta2 --clip --clip-mode --accumulation --window --device "
               "--precision "
               "--device-budget-mb --resident-blocks --host-memory --nvme --nvme-states --nvme-cache-blocks "
               "--nvme-sparse --steps --seed --log-every --eval-every --eval-batches --trace --quiet "
               "--metrics-file --tensorboard --checkpoint-dir --checkpoint-every --keep --resume --overwrite --tp --dp "
               "--dp-split --pp --micro-batches --pp-schedule --pp-chunks "
               "--dist-timeout --schedule --relay-activations --offload-activations --layer-drop --layer-drop-seed "
               "--max-skipped-steps --head-tail --lora-rank --lora-alpha --lora-targets --lora-dropout --freeze").split()


def _train(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def _flags(usage: str) -> list[str]:
    """The options of a usage line, in order (without --help)."""
    return [f for f in re.findall(r"\[(--[a-z0-9-]+)", usage) if f != "--help"]


def test_train_keeps_every_flag_and_nothing_of_the_runtime_leaks_in(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert sorted(_flags(usage)) == sorted(TRAIN_FLAGS)


def test_runtime_flags_set_the_runtime_config_field_they_name():
    rt = _train("--window", "3", "--device", "cpu", "--precision", "bf16", "--clip", "0.5", "--accumulation", "2",
                "--resident-blocks", "1", "--host-memory", "8GiB", "--nvme", "/tmp", "--nvme-states", "all",
                "--nvme-cache-blocks", "2", "--nvme-sparse").runtime
    assert (rt.window, rt.precision, rt.clip_grad_norm, rt.accumulation_steps, rt.resident_blocks) == (3, "bf16", 0.5, 2, 1)
    assert (rt.host_memory_bytes, rt.nvme_dir, rt.nvme_states, rt.nvme_cache_blocks) == (8 * 2**30, "/tmp", "all", 2)
    assert rt.nvme_preallocate is False
    assert _train("--clip", "0").runtime.clip_grad_norm is None  # 0: no clipping
    assert _train("--window", "all").runtime.window == "all" and _train("--window", "auto").runtime.window == "auto"


def test_train_defaults_are_the_ones_it_always_had():
    config = _train()
    rt = config.runtime
    assert (rt.window, rt.device, rt.precision, rt.clip_grad_norm, rt.accumulation_steps) == (2, "cpu", "fp32", 1.0, 1)
    assert (rt.resident_blocks, rt.host_memory_bytes, rt.nvme_dir, rt.nvme_states) == (0, None, None, "auto")
    assert (rt.nvme_cache_blocks, rt.nvme_preallocate, rt.checkpointing, rt.overlap) == (4, True, True, "auto")
    assert config.auto_window.device_budget_mb == 0.0
    # the fields train does not expose keep RuntimeConfig's own defaults
    own = RuntimeConfig()
    for name in ("strict", "copy_threads", "init_threads", "initial_loss_scale", "loss_scale_interval"):
        assert getattr(rt, name) == getattr(own, name), name


def test_help_of_a_runtime_option_is_its_field_metadata(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--clip X Clip the global gradient norm to this value; 0: no clipping. (default: 1.0)" in out
    assert "--nvme-sparse Do not reserve the NVMe tier's disk space at the start" in out
    assert "--accumulation N Micro-batches per optimizer step. (default: 1)" in out


def test_offload_activations_is_on_off_auto_or_a_device_byte_budget():
    assert _train().runtime.offload_block_inputs == "auto" and _train().runtime.head_tail_on_host == "auto"
    assert _train("--offload-activations", "auto").runtime.offload_block_inputs == "auto"
    assert _train("--offload-activations", "on").runtime.offload_block_inputs is True
    assert _train("--offload-activations", "off").runtime.offload_block_inputs is False
    assert _train("--offload-activations", "2GiB").runtime.offload_block_inputs == 2 * 2**30


@pytest.mark.parametrize("argv, message", [
    (["--offload-activations", "yes"],
     "--offload-activations must be 'on', 'off', 'auto' or a size in bytes like 12e9, 8G or 8GiB, got 'yes'"),
    (["--offload-activations", "on", "--accumulation", "2", "--schedule", "relay"],
     "--offload-activations applies to the default schedule; the relay schedule stages saved block inputs "
     "beyond --relay-activations bytes"),
    (["--clip", "-1"], "--clip must be > 0 (--clip 0: no clipping), got -1.0"),
    (["--clip", "much"], "--clip must be a number, got 'much'"),
    (["--accumulation", "0"], "--accumulation must be an int >= 1, got 0"),
    (["--nvme-cache-blocks", "0"], "--nvme-cache-blocks must be an int >= 1, got 0"),
    (["--window", "two"], "--window must be an int >= 1, 'all' or 'auto', got 'two'"),
    (["--nvme-states", "all"], "--nvme-states all needs --nvme (where the states go)"),
    (["--device", "cuda:x"], "--device must be 'cpu' or 'cuda[:n]', got 'cuda:x'"),
])
def test_a_bad_runtime_value_is_one_line_naming_the_flag(capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"pystronghold train: error: {message}"


def test_the_same_error_names_the_field_in_python():
    with pytest.raises(ConfigError) as info:
        RuntimeConfig(nvme_states="all")
    assert str(info.value) == "RuntimeConfig.nvme_states='all' needs nvme_dir (where the states go)"
    assert info.value.on_command_line() == "--nvme-states all needs --nvme (where the states go)"
    with pytest.raises(ValueError, match=r"^RuntimeConfig.clip_grad_norm must be > 0 \(clip_grad_norm=None: "):
        RuntimeConfig(clip_grad_norm=0.0)
