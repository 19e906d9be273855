"""The planner's relay model: link bytes per step equal what the runtime's trace counts, saved block
inputs staged when the device cannot hold them, and the choice of schedule."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from pystronghold.models import PRESETS, GPTConfig
from pystronghold.planner import Hardware, Workload, gpu_preset, make_plan
from pystronghold.planner.hardware import GiB
from pystronghold.planner.relay import choose_schedule, schedule_estimates
from runtime_models import gpt_batches, one_torch_thread, tiny_gpt
from relay_training import train

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def hw(gpu="rtx4090", host_gib=128):
    return Hardware(gpu=gpu_preset(gpu), host_memory_bytes=host_gib * GiB, nvme_bytes=0)


@pytest.mark.parametrize("m,resident", [(1, 0), (3, 0), (3, 1)])
def test_link_bytes_per_step_equal_the_runtime_trace(m, resident):
    """K resident blocks cross no link: only the N - K streamed ones are loaded and copied out."""
    model = tiny_gpt(4)
    cfg: GPTConfig = model.config
    plan = make_plan(cfg, Workload(batch=2, seq=cfg.seq_len, precision="fp32"), hw(), window=2,
                     resident_blocks=resident)
    est = schedule_estimates(plan, m)
    steps = 2
    batches = gpt_batches(steps * m)
    for schedule in ("default", "relay"):
        _, _, h2d, d2h, _ = train(copy.deepcopy(model), batches, m, schedule=schedule, steps=steps, window=2,
                                  resident_blocks=resident)
        assert sum(e.nbytes for e in h2d) == steps * est[schedule].h2d_bytes, schedule
        assert sum(e.nbytes for e in d2h) == steps * est[schedule].d2h_bytes, schedule
    assert est["relay"].saved_input_bytes == m * est["default"].saved_input_bytes


def test_relay_moves_m_times_fewer_bytes_and_stages_inputs_that_do_not_fit():
    cfg = PRESETS["gpt3-1.3b"]
    work = Workload(batch=4, precision="bf16")
    plan = make_plan(cfg, work, hw(host_gib=512), resident_blocks=0)  # every block streamed
    m = 16
    est = schedule_estimates(plan, m)
    d, r = est["default"], est["relay"]
    assert r.d2h_bytes * m == d.d2h_bytes and r.activations == "device"
    assert r.step_s <= d.step_s
    # a device with little room for activations: the relay's m·N inputs go through host memory
    small = make_plan(cfg, work, Hardware(gpu=dataclasses.replace(gpu_preset("rtx4090"),
                                                                  memory_bytes=plan.device.peak_bytes + GiB),
                                          host_memory_bytes=512 * GiB), window=plan.window, resident_blocks=0)
    staged = schedule_estimates(small, m)["relay"]
    assert staged.saved_input_bytes > staged.device_budget_bytes and staged.activations == "host"
    assert staged.h2d_bytes == r.h2d_bytes + staged.saved_input_bytes
    assert schedule_estimates(small, 1)["relay"].activations == "device"


def test_relay_is_chosen_when_loads_outlast_compute_never_at_one_micro_batch():
    cfg = PRESETS["gpt3-1.3b"]
    plan = make_plan(cfg, Workload(batch=1, precision="bf16"), hw(host_gib=512), resident_blocks=0)
    assert choose_schedule(plan, 1)[0] == "default"
    # link-bound at batch 1 on PCIe: each block's load outlasts its compute, so loading it once
    # per step instead of once per micro-batch wins
    assert plan.costs.load_s > plan.costs.fwd_s
    assert choose_schedule(plan, 8)[0] == "relay"
    with pytest.raises(ValueError, match="micro_batches"):
        schedule_estimates(plan, 0)


def test_cli_plan_reports_the_schedule_choice(capsys):
    """`pystronghold plan --accumulation m` says which schedule --schedule auto picks (choose_schedule)
    and what each moves; an explicit --schedule is reported as given."""
    import json

    from pystronghold.cli import main

    args = ["plan", "--gpu", "rtx4090", "--host-memory", "512", "--model", "gpt3-1.3b", "--batch", "1",
            "--precision", "bf16", "--resident-blocks", "0", "--json"]
    assert main([*args, "--accumulation", "8"]) == 0
    out = json.loads(capsys.readouterr().out)["schedule"]
    plan = make_plan(PRESETS["gpt3-1.3b"], Workload(batch=1, precision="bf16"), hw(host_gib=512),
                     resident_blocks=0)
    chosen, estimates = choose_schedule(plan, 8)
    assert (out["requested"], out["chosen"], out["micro_batches"]) == ("auto", chosen, 8) and chosen == "relay"
    assert out["estimates"]["relay"]["h2d_bytes"] == estimates["relay"].h2d_bytes
    assert main([*args, "--accumulation", "8", "--schedule", "default"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"]["chosen"] == "default"
    assert main(args) == 0  # one micro-batch: the two schedules are the same step
    assert json.loads(capsys.readouterr().out)["schedule"]["chosen"] == "default"
    assert main(args[:-1] + ["--accumulation", "8"]) == 0
    text = capsys.readouterr().out
    assert "schedule (8 micro-batches per step): relay" in text
    assert "\n  default  step" in text and "\n  relay    step" in text


def test_one_micro_batch_prints_one_schedule_row(capsys):
    """With one micro-batch the default and relay schedules are the same step: one row, and why."""
    from pystronghold.cli import main

    assert main(["plan", "--gpu", "rtx4090", "--host-memory", "512", "--model", "gpt3-1.3b", "--widths", "2048"]) == 0
    text = capsys.readouterr().out
    assert "schedule (1 micro-batch per step): default (the relay is the same with one micro-batch)" in text
    assert text.count("\n  default  step") == 1 and "\n  relay    step" not in text
