"""What `pystronghold plan` prints where a newcomer misread it: no "W 0" for a plan that streams
nothing, shares that are not zero never printed as "0%", and a host that is too small names --nvme."""

from __future__ import annotations

import dataclasses

from pystronghold.cli import main
from pystronghold.models import PRESETS
from pystronghold.planner import Workload, gpu_preset, make_plan
from pystronghold.planner.hardware import GiB, Hardware
from pystronghold.planner.plan import LargestModel
from pystronghold.planner.report import format_plan

H100 = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 * GiB)


def _all_resident_plan():
    plan = make_plan(PRESETS["gpt3-125m"], Workload(batch=1, seq=2048), H100)
    assert plan.fits and plan.streamed_blocks == 0 and plan.window == 0
    return plan


def test_a_plan_that_streams_nothing_prints_no_window_of_0():
    plan = _all_resident_plan()
    plan.largest = [LargestModel(hidden=4096, heads=32, layers=18, params=3_840_000_000, bound="host", window=0,
                                 step_s=0.146),
                    LargestModel(hidden=2048, heads=16, layers=74, params=3_830_000_000, bound="host", window=4,
                                 step_s=0.155)]
    text = format_plan(plan)
    assert "window W  none (every block resident: nothing streams" in text, text
    assert "streamed  0 blocks: no window, no host store" in text, text
    assert "W=0" not in text and "0 x " not in text and "up to 0 fit" not in text, text
    largest = text[text.index("largest trainable model"):].splitlines()
    assert largest[2].split()[-3] == "none" and largest[3].split()[-3] == "4", largest  # the W column


def test_step_shares_that_round_to_0_or_100_say_so():
    plan = _all_resident_plan()
    plan.step = dataclasses.replace(plan.step, total_s=1.0, compute_s=0.996, exposed_transfer_s=0.004,
                                    exposed_optimizer_s=0.0)
    rows = {line.rsplit("  ", 1)[0].split("  ")[0]: line.split()[-1] for line in format_plan(plan).splitlines()
            if line.startswith(("compute ", "exposed "))}
    assert rows == {"compute": ">99%", "exposed transfer": "<1%", "exposed optimizer": "0%"}, rows


def test_a_host_too_small_names_nvme(capsys):
    rc = main(["plan", "--gpu", "rtx3090", "--host-memory", "32", "--model", "gpt3-13b", "--widths", "2048"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT: host memory (--nvme GB puts optimizer states on NVMe)" in out, out
