"""The planner's split of the blocks: K device-resident (device AdamW, no transfers, no host update,
activations kept unless memory demands recompute), N - K streamed through W slots. Step times
worked out by hand, the choice against brute force, memory against its parts, the CLI, and the
H100 targets (predicted step within 1.1x of compute)."""

import dataclasses
import json
import random
from dataclasses import replace

import pytest

from pystronghold.cli import main
from pystronghold.models import PRESETS
from pystronghold.planner import Hardware, Workload, gpu_preset, make_plan
from pystronghold.planner.cost import BlockCosts
from pystronghold.planner.hardware import GiB
from pystronghold.planner.memory import device_memory
from pystronghold.planner.plan import choose_split, max_window_with
from pystronghold.planner.report import format_plan
from pystronghold.planner.timeline import simulate_step


def costs(fwd=1.0, bwd=3.0, recompute=1.0, load=0.0, grad=0.0, adam=0.0, device_adam=0.0, tail=0.0,
          slot=10, resident=20, act=8, inp=1) -> BlockCosts:
    return BlockCosts(block_params=1, block_numel=16, slot_bytes=slot, head_tail_bytes=0, block_input_bytes=inp,
                      block_activation_bytes=act, tail_activation_bytes=0, fwd_s=fwd, bwd_s=bwd,
                      head_tail_s=tail, load_s=load, grad_s=grad, allreduce_s=0.0, adam_s=adam,
                      recompute_s=recompute, resident_block_bytes=resident, device_adam_s=device_adam)


def test_every_block_resident_is_plain_compute():
    # 3 blocks: forward 1 s, backward 3 - 1 (no recompute) s, device AdamW 0.2 s each; loads, copies
    # and host updates cost nothing because there are none
    c = costs(load=5.0, grad=5.0, adam=7.0, device_adam=0.2, tail=0.5)
    st = simulate_step(c, 3, 0, resident=3)
    assert st.total_s == pytest.approx(3 * 1 + 0.5 + 3 * 2 + 3 * 0.2)
    assert st.compute_s == pytest.approx(st.total_s)
    assert st.exposed_transfer_s == pytest.approx(0) and st.exposed_optimizer_s == pytest.approx(0)
    recomputing = simulate_step(c, 3, 0, resident=3, resident_recompute=True)
    assert recomputing.total_s == pytest.approx(st.total_s + 3 * 1.0)


def test_resident_first_blocks_give_the_host_updates_time_to_hide():
    # W = 3, no recompute anywhere; Adam 3 s per block: with K = 0 it delays the next forward by 5 s
    # (test_planner_timeline). Each resident block removes a host update and adds its forward and
    # backward to the time the others have to finish.
    c = costs(bwd=2.0, recompute=0.0, adam=3.0)
    exposed = [simulate_step(c, 3, 3 - k if k < 3 else 0, resident=k).exposed_optimizer_s for k in range(4)]
    assert exposed[0] == pytest.approx(5.0)
    assert exposed == sorted(exposed, reverse=True) and exposed[3] == 0
    assert exposed[2] == pytest.approx(0.0)  # one streamed block's 3 s hide behind 2 blocks' 6 s


def test_resident_blocks_do_not_use_the_link():
    # one slot, loads 0.5 s: 3 streamed blocks expose 5 loads (test_planner_timeline); with the
    # first 2 resident, the remaining one loads during their forward (the prologue)
    c = costs(bwd=2.0, recompute=0.0, load=0.5)
    assert simulate_step(c, 3, 1).exposed_transfer_s == pytest.approx(2.5)
    assert simulate_step(c, 3, 1, resident=2).exposed_transfer_s == pytest.approx(0.0)


def test_device_memory_counts_resident_blocks_and_their_activations():
    work = Workload(batch=1, device_reserve_bytes=0)
    c = costs(slot=10, resident=20, act=8, inp=1)
    # K = 2 keep activations, 3 streamed recompute (inputs only), 2 slots
    d = device_memory(c, work, 5, 2, 10**6, resident=2)
    assert d.resident_bytes == 40 and d.window_bytes == 20
    working = 8 + 2 * 1  # one block's recompute plus dy, dx
    assert d.activation_bytes == 2 * 8 + 3 * 1 + working
    assert device_memory(c, work, 5, 2, 10**6, resident=2, resident_recompute=True).activation_bytes == 5 + working
    # every block resident, none recomputes: plain PyTorch's activations (the last block's gradients
    # beside every block's activations)
    plain = device_memory(c, work, 5, 0, 10**6, resident=5)
    assert plain.window_bytes == 0 and plain.activation_bytes == 5 * 8 + 2 * 1
    # a pipeline stage with 3 micro-batches in flight: each keeps the resident blocks' activations and
    # the streamed blocks' inputs; the one working set is there once
    staged = device_memory(c, work, 5, 2, 10**6, resident=2, in_flight=3)
    assert staged.activation_bytes == 3 * (2 * 8 + 3 * 1) + working
    assert device_memory(c, work, 5, 0, 10**6, resident=5, in_flight=3).activation_bytes == 3 * 5 * 8 + 2 * 1


def _brute_force(c, work, n, capacity):
    best = None
    for k in range(n + 1):
        for rc in (False, True):
            max_w = max_window_with(c, work, n, capacity, k, rc)
            for w in ([0] if k == n else range(1, max_w + 1)):
                if max_w < 0:
                    continue
                t = simulate_step(c, n, w, work.overlap, resident=k, resident_recompute=rc).total_s
                best = t if best is None else min(best, t)
    return best


def test_choose_split_is_as_good_as_brute_force_and_fits():
    rng = random.Random(3)
    work = Workload(batch=1, device_reserve_bytes=0)
    for _ in range(30):
        c = costs(fwd=rng.uniform(0.1, 1), bwd=rng.uniform(0.3, 3), load=rng.uniform(0, 2),
                  grad=rng.uniform(0, 2), adam=rng.uniform(0, 4), device_adam=rng.uniform(0, 0.2),
                  slot=rng.randint(5, 20), resident=rng.randint(10, 40), act=rng.randint(2, 30))
        c = replace(c, recompute_s=min(c.fwd_s, c.bwd_s))
        n = rng.randint(1, 8)
        capacity = rng.randint(40, 400)
        best = _brute_force(c, work, n, capacity)
        split = choose_split(c, work, n, capacity)
        if best is None:
            assert split.step is None
            continue
        assert split.step.total_s <= best * 1.01 + 1e-9
        assert device_memory(c, work, n, split.window, capacity, split.resident,
                             split.resident_recompute).fits
        assert split.window <= split.max_window and (split.window >= 1 or split.resident == n)


def test_ties_go_to_more_resident_blocks():
    # free host updates and transfers: every split has the same step, so every block stays
    c = costs(recompute=0.0)
    split = choose_split(c, Workload(batch=1, device_reserve_bytes=0), 4, 10**6)
    assert (split.resident, split.window, split.resident_recompute) == (4, 0, False)


def test_memory_decides_the_recompute():
    # resident blocks that keep activations (8 each) do not fit beside each other; recomputing
    # ones (1 each) do: the planner keeps them resident and recomputes rather than streaming them
    work = Workload(batch=1, device_reserve_bytes=0)
    c = costs(adam=10.0, load=1.0, grad=1.0, resident=20, act=8)
    capacity = 4 * 20 + 4 * 1 + 10  # 4 resident + inputs + a working set, no room for activations
    split = choose_split(c, work, 4, capacity)
    assert split.resident == 4 and split.resident_recompute


H100 = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=125 * GiB, cpu_adam_params_per_s=4e9)
"""The H100 machine of ../shared/GPU.md: 80 GB, 16 cores, 125 GiB; its measured CPU Adam rate."""


@pytest.mark.parametrize("preset", ["gpt3-1.3b", "gpt3-6.7b"])
def test_h100_predicted_step_is_within_1_1x_of_compute(preset):
    """The CPU target: with K chosen well the host work hides (batch 4 x 2048, bf16)."""
    plan = make_plan(PRESETS[preset], Workload(batch=4, seq=2048, precision="bf16"), H100)
    assert plan.fits and plan.step is not None
    assert plan.step.total_s <= 1.1 * plan.step.compute_s, plan.step
    assert plan.device.peak_bytes <= H100.gpu.memory_bytes
    if preset == "gpt3-1.3b":  # it fits whole: plain PyTorch, no recompute, no host work
        assert (plan.resident_blocks, plan.window, plan.recomputed_blocks) == (24, 0, 0)
    else:  # 6.7B does not: some blocks stream, and it is still faster than streaming them all
        assert 0 < plan.resident_blocks < 32
        all_streamed = make_plan(PRESETS[preset], plan.work, H100, resident_blocks=0)
        assert plan.step.total_s < 0.75 * all_streamed.step.total_s


def test_phase_aware_peak_keeps_more_blocks_resident_at_6_7b_b16():
    """GPT 6.7B, b16 x 2048, bf16, clipping (forward overlap) on an H100: counting the fp32
    gradient copies of all K resident blocks beside the activations (the old rule: the costs with
    those copies in the persistent bytes) keeps 14 blocks; with the step phase apart, 18. The
    H100 measured a peak of the step phase alone (50.6 GiB at K = 12, docs/BENCHMARKS.md). Both
    with the full logits; the loss over chunks (the default) frees room for 2 more."""
    hw = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=512 * GiB)
    plan = make_plan(PRESETS["gpt3-6.7b"], Workload(batch=16, seq=2048, overlap="forward", loss_chunk_tokens=0), hw)
    c = plan.costs
    old_rule = replace(c, head_tail_fp32_grad_bytes=0, resident_fp32_grad_bytes=0)
    before = choose_split(old_rule, plan.work, 32, hw.gpu.memory_bytes)
    assert (before.resident, plan.resident_blocks) == (14, 18) and plan.device.fits
    chunked = make_plan(PRESETS["gpt3-6.7b"], Workload(batch=16, seq=2048, overlap="forward"), hw)
    assert chunked.resident_blocks == 20 and chunked.device.fits


def test_resident_blocks_as_asked_and_host_store_of_the_streamed_ones():
    cfg, work = PRESETS["gpt3-1.3b"], Workload(batch=4, seq=2048, precision="bf16")
    k0, k8 = make_plan(cfg, work, H100, resident_blocks=0), make_plan(cfg, work, H100, resident_blocks=8)
    assert (k0.resident_blocks, k8.resident_blocks, k8.resident_asked) == (0, 8, 8)
    per_block = (k0.host.host_bytes - work.host_reserve_bytes) / 24
    assert k8.host.host_bytes - work.host_reserve_bytes == pytest.approx(16 * per_block, rel=1e-3)
    with pytest.raises(ValueError, match="resident_blocks must be an int in"):
        make_plan(cfg, work, H100, resident_blocks=25)


def test_report_prints_the_split(capsys):
    rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--model", "gpt3-6.7b", "--batch", "4",
               "--seq", "2048", "--cpu-adam-rate", "4", "--widths", "4096"])
    text = capsys.readouterr().out
    assert rc == 0
    for words in ("blocks (chosen) with device AdamW", "streamed", "slots", "recompute", "device: resident blocks",
                  "device AdamW"):
        assert words in text, words
    rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--model", "gpt3-1.3b",
               "--resident-blocks", "10", "--widths", "2048", "--json"])
    split = json.loads(capsys.readouterr().out)["split"]
    assert rc == 0 and split["resident_blocks"] == 10 and split["resident_asked"] == 10
    assert split["streamed_blocks"] == 14 and split["resident_bytes"] > 0 and split["window_bytes"] > 0


@pytest.mark.parametrize("value,message", [("x", "--resident-blocks must be an int >= 0 or 'auto'"),
                                           ("30", "--resident-blocks (30) is more than the model's 24 blocks")])
def test_bad_resident_blocks_give_one_line(value, message, capsys):
    rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--model", "gpt3-1.3b",
               "--resident-blocks", value])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_format_plan_every_block_resident():
    plan = make_plan(PRESETS["gpt3-1.3b"], Workload(batch=1, seq=2048), H100)
    text = format_plan(plan)
    assert "every block resident: nothing streams" in text and "24 of 24 blocks" in text
    c = plan.costs  # the fp32 gradient copies are the step phase's (DeviceMemory.step_grad_bytes)
    assert dataclasses.asdict(plan.device)["resident_bytes"] == 24 * (c.resident_block_bytes
                                                                     - c.resident_fp32_grad_bytes)
