"""Plans: memory bounds are tight (the answer fits, one more does not), tiers, the CLI."""

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import pytest

from pystronghold.cli import main
from pystronghold.models import PRESETS, param_count
from pystronghold.planner import Hardware, Workload, gpu_preset, largest_layers, largest_models, make_plan
from pystronghold.options import add_options, field_docs, from_args
from pystronghold.planner.hardware import GiB, local_host_memory_bytes
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.planner.command import PLAN_RUNTIME_DEFAULTS
from pystronghold.train.config import TRAIN_RUNTIME_DEFAULTS
from pystronghold.planner.report import format_plan, plan_to_dict

CFG = PRESETS["gpt3-1.3b"]
WORK = Workload(batch=2, precision="bf16")


def hw(gpu="rtx4090", host_gib=128, nvme_gib=0):
    return Hardware(gpu=gpu_preset(gpu), host_memory_bytes=host_gib * GiB, nvme_bytes=nvme_gib * GiB)


def test_device_peak_is_the_larger_phase_and_max_window_is_tight():
    cfg = dataclasses.replace(CFG, layers=128)  # more slots than a 24 GB device holds
    plan = make_plan(cfg, WORK, hw(host_gib=4096))
    d, c = plan.device, plan.costs
    held = d.window_bytes + d.head_tail_bytes + d.resident_bytes + d.reserve_bytes
    assert d.backward_bytes == held + d.activation_bytes and d.step_bytes == held + d.step_grad_bytes
    assert d.peak_bytes == max(d.backward_bytes, d.step_bytes)
    # the fp32 gradient copies are out of the phase that holds the activations: head/tail's and
    # one resident block's are in the step's, not K blocks'
    assert plan.resident_blocks > 1 and c.resident_fp32_grad_bytes == 4 * c.block_params > 0
    assert d.resident_bytes == plan.resident_blocks * (c.resident_block_bytes - c.resident_fp32_grad_bytes)
    assert d.head_tail_bytes == c.head_tail_bytes - c.head_tail_fp32_grad_bytes
    assert d.step_grad_bytes == c.head_tail_fp32_grad_bytes + c.resident_fp32_grad_bytes
    assert 1 <= plan.max_window < cfg.layers
    k = plan.resident_blocks
    assert make_plan(cfg, WORK, hw(host_gib=4096), window=plan.max_window, resident_blocks=k).fits
    too_many = make_plan(cfg, WORK, hw(host_gib=4096), window=plan.max_window + 1, resident_blocks=k)
    assert not too_many.fits and too_many.step is None
    assert plan.window <= plan.max_window and plan.step is not None


def test_either_phase_can_be_the_peak():
    """Long sequences: the activations make forward/backward the peak; short ones with every block
    resident: the step's fp32 gradient copies do. In fp32 there are no copies."""
    small = dataclasses.replace(CFG, layers=4)
    long = make_plan(CFG, WORK, hw(host_gib=512), resident_blocks=0).device
    short = make_plan(small, Workload(batch=1, seq=16), hw(gpu="h100-80gb"), resident_blocks=4).device
    assert long.peak_bytes == long.backward_bytes > long.step_bytes
    assert short.peak_bytes == short.step_bytes > short.backward_bytes
    fp32 = make_plan(small, Workload(batch=1, seq=16, precision="fp32"), hw(gpu="h100-80gb"), resident_blocks=4)
    assert fp32.device.step_grad_bytes == 0 and fp32.device.peak_bytes == fp32.device.backward_bytes


def test_checkpointing_saves_device_memory():
    plan = make_plan(CFG, WORK, hw(), resident_blocks=0)
    ckpt = plan.device.activation_bytes
    kept = make_plan(CFG, dataclasses.replace(WORK, checkpointing=False), hw(),
                     resident_blocks=0).device.activation_bytes
    c = plan.costs
    # every block but one keeps its full activations instead of its input
    assert kept - ckpt >= (CFG.layers - 1) * (c.block_activation_bytes - c.block_input_bytes)
    assert kept > 2 * ckpt


@pytest.mark.parametrize("host_gib,bound", [(64, "host"), (100000, "device")])
def test_largest_model_fits_and_one_more_layer_does_not(host_gib, bound):
    h = hw(host_gib=host_gib)
    layers, why = largest_layers(CFG, WORK, h)
    assert why == bound
    assert make_plan(dataclasses.replace(CFG, layers=layers), WORK, h).fits
    assert not make_plan(dataclasses.replace(CFG, layers=layers + 1), WORK, h).fits


def test_nvme_tier_places_states_as_the_runtime_does():
    """The planner's disk placement is the runtime's (plan_placement): moments first, then the
    master; the host part (with its staging cache) fits the host, the rest is on disk."""
    cfg = dataclasses.replace(CFG, layers=200)
    short = make_plan(cfg, WORK, hw(host_gib=64))
    assert short.host.tier == "host" and not short.fits
    plan = make_plan(cfg, WORK, hw(host_gib=64, nvme_gib=2000))
    assert plan.host.tier == "nvme" and plan.fits
    assert plan.host.host_bytes <= 64 * GiB
    assert {"exp_avg", "exp_avg_sq"} <= set(plan.host.disk_states)
    assert plan.host.disk_bytes >= 200 * plan.costs.block_params * 8 * 0.5
    assert plan.host.disk_step_bytes >= 2 * plan.host.disk_bytes * 0.9
    assert plan.step.exposed_optimizer_s > 0  # the disk is slower than the host Adam here
    roomy = make_plan(cfg, WORK, hw(host_gib=4096, nvme_gib=2000))
    assert roomy.host.tier == "host" and roomy.host.disk_bytes == 0


def test_largest_models_table_rows():
    rows = largest_models(CFG, WORK, hw(host_gib=256), widths=[1024, 2048, 4096])
    assert [r.hidden for r in rows] == [1024, 2048, 4096]
    for r in rows:
        assert r.layers > 0 and r.window >= 1 and r.step_s > 0
        assert r.params == param_count(dataclasses.replace(CFG, hidden=r.hidden, heads=r.heads, layers=r.layers))


def test_report_text_and_json():
    plan = make_plan(CFG, WORK, hw())
    plan.largest = largest_models(CFG, WORK, hw(), widths=[2048])
    text = format_plan(plan)
    for word in ("window W", "device: peak", "exposed transfer", "exposed optimizer", "largest trainable"):
        assert word in text
    d = json.loads(json.dumps(plan_to_dict(plan)))
    assert d["window"]["chosen"] == plan.window and d["device"]["peak_bytes"] == plan.device.peak_bytes
    assert d["step"]["total_s"] == pytest.approx(d["step"]["compute_s"] + d["step"]["exposed_transfer_s"]
                                                 + d["step"]["exposed_optimizer_s"])


def test_cli_plan_json(capsys):
    rc = main(["plan", "--gpu", "a100-40gb", "--host-memory", "256", "--model", "gpt3-1.3b",
               "--window", "3", "--widths", "2048", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and out["window"]["chosen"] == 3 and out["window"]["asked"] == 3
    assert out["model"]["layers"] == 24 and len(out["largest"]) == 1


def test_cli_custom_gpu_and_shape(capsys):
    rc = main(["plan", "--gpu-memory", "16", "--gpu-tflops", "50", "--host-memory", "64",
               "--layers", "30", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--widths", "2048"])
    out = capsys.readouterr().out
    assert rc == 0 and "30 layers x 2048 hidden" in out and "custom-16gb" in out


def test_cli_does_not_fit_exits_1(capsys):
    rc = main(["plan", "--gpu", "rtx3090", "--host-memory", "32", "--model", "gpt3-13b", "--widths", "2048"])
    assert rc == 1 and "DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--gpu", "b300", "--host-memory", "64", "--model", "tiny"], "unknown GPU 'b300'"),
    (["--gpu", "rtx3090", "--host-memory", "64", "--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--gpu", "rtx3090", "--host-memory", "-1", "--model", "tiny"], "--host-memory must be a positive"),
    (["--host-memory", "8", "--model", "tiny"], "give --gpu NAME"),
    (["--host-memory", "8"], "give --gpu NAME (or --gpu-memory GB and --gpu-tflops X) and --model PRESET (or "
                             "--layers, --hidden and --heads)"),
    (["--gpu-memory", "8", "--host-memory", "8", "--model", "tiny"], "needs both"),
    (["--gpu", "rtx3090", "--host-memory", "8", "--layers", "4"], "--layers, --hidden and --heads"),
    (["--gpu", "rtx3090", "--host-memory", "8", "--model", "tiny", "--window", "0"], "--window must be"),
    (["--gpu", "rtx3090", "--host-memory", "8", "--model", "tiny", "--batch", "0"], "--batch must be"),
    (["--gpu", "v100-16gb", "--host-memory", "8", "--model", "tiny", "--precision", "bf16"], "no bf16"),
    (["--gpu", "rtx3090", "--host-memory", "8", "--layers", "x"], "invalid int value"),
])
def test_cli_bad_inputs_give_one_line(args, message, capsys):
    try:
        rc = main(["plan", *args])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_bad_input_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "pystronghold", "plan", "--gpu", "nope", "--host-memory", "8",
                           "--model", "tiny"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["pystronghold plan: error: unknown GPU 'nope'; known: "
                                                "v100-16gb, v100-32gb, v100-pcie-32gb, p100-16gb, "
                                                "p100-pcie-16gb, a100-40gb, a100-80gb, h100-80gb, "
                                                "rtx3090, rtx4090, h200-141gb, gh200-96gb, b200-180gb, "
                                                "l40s-48gb, rtx5090, rtx-pro-6000"]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "--gpu-memory" in out and "Device memory in GiB" in out


def test_every_request_field_is_a_documented_option():
    from pystronghold.planner.command import PlanRequest

    docs = field_docs(PlanRequest)
    names = [f.name for f in dataclasses.fields(PlanRequest)]
    assert set(docs) == set(names) and all(docs.values())
    parser = argparse.ArgumentParser()
    add_options(parser, PlanRequest)
    base = ["--gpu", "h100-80gb", "--host-memory", "64", "--model", "tiny"]
    request = from_args(PlanRequest, parser.parse_args(
        base + ["--gpu-memory", "12.5", "--no-checkpointing", "--json", "--layers", "3", "--window", "4"]))
    assert request.gpu_memory == 12.5 and request.json is True and request.layers == 3
    assert request.runtime.checkpointing is False and request.runtime.window == 4  # RuntimeConfig's fields
    default = from_args(PlanRequest, parser.parse_args(base))
    assert default.runtime.checkpointing is True and default.json is False
    assert default.runtime.window == "auto"  # the plan's default
    # the precision is train's: one default, RuntimeConfig's, which neither command overrides
    assert default.runtime.precision == RuntimeConfig().precision
    assert "precision" not in PLAN_RUNTIME_DEFAULTS and "precision" not in TRAIN_RUNTIME_DEFAULTS
    assert from_args(PlanRequest, parser.parse_args(base[:2] + base[4:])).host_memory is None  # this machine's


def test_json_of_a_model_that_does_not_fit(capsys):
    rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "64", "--model", "gpt3-175b", "--widths", "4096",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and not out["fits"] and out["step"] is None and out["window"]["chosen"] is None
    assert not out["host"]["fits"] and out["largest"][0]["layers"] > 0


def test_plan_reuses_the_runtime_window_and_its_validation(capsys):
    """--window is RuntimeConfig's field: one validation, and 'all' plans every block on the device."""
    base = ["plan", "--gpu", "h100-80gb", "--host-memory", "256", "--model", "gpt3-1.3b", "--json"]
    assert main(base + ["--window", "0"]) == 2
    assert capsys.readouterr().err.strip() == "pystronghold plan: error: --window must be >= 1, got 0"
    assert main(base + ["--window", "all"]) == 0  # 'all' is RuntimeConfig's too: every block on the device
    assert '"chosen": 24' in capsys.readouterr().out




def test_host_memory_defaults_to_this_machine(capsys):
    """Without --host-memory the plan is of this machine's RAM, and says so."""
    from pystronghold.planner.hardware import format_bytes

    args = ["plan", "--gpu", "h100-80gb", "--model", "mini", "--widths", "128"]
    assert main(args) == 0
    ram = local_host_memory_bytes()
    assert capsys.readouterr().out.startswith(f"host memory: {format_bytes(ram)} (this machine")
    assert main([*args, "--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert (hardware["host_memory_bytes"], hardware["host_memory_from"]) == (ram, "this machine")
    assert main([*args, "--host-memory", "64", "--json"]) == 0
    hardware = json.loads(capsys.readouterr().out)["hardware"]
    assert (hardware["host_memory_bytes"], hardware["host_memory_from"]) == (64 * GiB, "--host-memory")


def test_small_models_print_small_units(capsys):
    """A 1.9 M-parameter model's bytes and seconds read in MiB/KiB and us, not 0.0 GiB and 0.0 ms."""
    assert main(["plan", "--gpu", "h100-80gb", "--host-memory", "64", "--model", "mini", "--widths", "128"]) == 0
    text = capsys.readouterr().out
    assert not re.search(r"(?<![\d,])0\.0+ GiB", text) and "fwd 0.0 ms" not in text, text
    assert "device: resident blocks  24.2 MiB  8 x 3.0 MiB" in text and " us, bwd " in text
