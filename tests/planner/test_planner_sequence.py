"""The planner knows the sequence: activation bytes per token against what autograd saves, the
long-context settings' bytes and costs, the longest-context search and the choice of the fewest
settings; the issue's goals as planner outputs (8B and 70B shapes on an H100 and an H200)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from pystronghold.models.gpt import GPT, GPTConfig
from pystronghold.planner import Hardware, Workload, gpu_preset, make_plan
from pystronghold.planner.cost import INPUTS_IN_FLIGHT, block_activation_bytes, block_costs, tail_activation_bytes
from pystronghold.planner.hardware import GiB
from pystronghold.planner.memory import device_memory
from pystronghold.planner.sequence import (SETTINGS, SequenceSettings, activation_bytes_per_token,
                                           choose_sequence_settings, loss_chunk_for, longest_context,
                                           mlp_tile_for, offload_link_bytes, plan_sequence)
from pystronghold.settings.finetune import FinetuneOptions
from runtime_models import saved_activation_bytes

MODELS = Path(__file__).resolve().parents[2] / "bench" / "models"
K = 1024


def _hw(gpu: str, host_gib: float = 125, nvme_gib: float = 2000) -> Hardware:
    return Hardware(gpu=gpu_preset(gpu), host_memory_bytes=int(host_gib * GiB), cpu_adam_params_per_s=2e9,
                    nvme_bytes=int(nvme_gib * GiB), nvme_bytes_per_s=3e9)


def test_activation_bytes_per_token_is_the_measured_slope():
    """A GPT block's saved bytes at T = 256 and 1024 (fp32, SDPA on the CPU): their difference per
    token is the formula's slope within 2% (LayerNorm statistics and the attention's log-sum-exp,
    left out of the formula, are the rest)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=1024, layers=1, hidden=64, heads=4)
    block = GPT(cfg).blocks[0]
    batch = 2
    low, high = (saved_activation_bytes(block, torch.randn(batch, t, 64, requires_grad=True)) for t in (256, 1024))
    slope = activation_bytes_per_token(cfg, Workload(precision="fp32"))
    assert slope == 16 * 64 * 4  # 16 (B, T, C)-sized tensors of 4 bytes per token
    assert slope <= (high - low) / (batch * (1024 - 256)) <= 1.02 * slope


def test_tiled_mlp_stops_the_mlp_growing_with_the_sequence():
    """With a tile, only the block's non-MLP terms grow with T: the GPT's 4 + 4 (B,T,C) tensors;
    the MLP's 2*F per token is held for one tile."""
    cfg = GPTConfig(vocab_size=256, seq_len=1 << 16, layers=2, hidden=64, heads=4)
    tiled = Workload(precision="fp32", mlp_tile_tokens=128)
    assert activation_bytes_per_token(cfg, tiled) == 8 * 64 * 4
    grow = block_activation_bytes(cfg, tiled, 8192) - block_activation_bytes(cfg, tiled, 4096)
    assert grow == 4096 * 8 * 64 * 4
    assert block_activation_bytes(cfg, tiled, 4096) == 4096 * 8 * 64 * 4 + 128 * 2 * 256 * 4


def test_chunked_loss_holds_one_chunk_of_fp32_logits_and_its_gradient():
    cfg = GPTConfig(vocab_size=1000, vocab_pad_multiple=128, seq_len=1 << 16, layers=2, hidden=64, heads=4)
    work = Workload(batch=2, precision="bf16", loss_chunk_tokens=256)
    T = 8192
    # one chunk's logits (bf16, then fp32 logits, softmax and gradient), the stored hidden-state gradient,
    # the head's fp32 gradient sum, the final norm's input and output
    assert tail_activation_bytes(cfg, work, T) == (256 * 1024 * (2 + 12) + 2 * T * 64 * 2 + 4 * 1024 * 64
                                                   + 2 * 2 * T * 64 * 2)
    assert tail_activation_bytes(cfg, dataclasses.replace(work, loss_chunk_tokens=0), T) == \
        3 * 2 * T * 1024 * 2 + 2 * 2 * T * 64 * 2  # unchunked: today's vocab-parallel formula


def test_offloaded_inputs_leave_two_on_the_device_and_go_to_the_host():
    cfg = GPTConfig(vocab_size=256, seq_len=4096, layers=12, hidden=256, heads=4)
    hw = _hw("h100-80gb", host_gib=64, nvme_gib=0)
    kept, off = Workload(seq=4096), Workload(seq=4096, offload_block_inputs=True)
    c = block_costs(cfg, kept, hw)
    dev_kept = device_memory(c, kept, 12, 2, hw.gpu.memory_bytes)
    dev_off = device_memory(c, off, 12, 2, hw.gpu.memory_bytes)
    assert dev_kept.activation_bytes - dev_off.activation_bytes == (12 - INPUTS_IN_FLIGHT) * c.block_input_bytes
    assert offload_link_bytes(cfg, off, 4096) == 2 * 12 * c.block_input_bytes
    plan_kept, plan_off = (make_plan(cfg, w, hw, window=2, resident_blocks=0) for w in (kept, off))
    assert plan_off.host.input_host_bytes == 12 * c.block_input_bytes
    assert plan_off.host.host_bytes - plan_kept.host.host_bytes == 12 * c.block_input_bytes


def test_offload_link_time_is_costed_when_it_outlasts_the_compute():
    """A slow link: each input copy outlasts its block's forward, and the step grows by at least
    the excess; a fast one hides it."""
    cfg = GPTConfig(vocab_size=256, seq_len=4096, layers=8, hidden=256, heads=4)
    for link, exposed in ((1e6, True), (1e15, False)):
        hw = _hw("h100-80gb", host_gib=64, nvme_gib=0)
        hw.gpu.h2d_bytes_per_s = hw.gpu.d2h_bytes_per_s = link
        base = make_plan(cfg, Workload(seq=4096), hw, window=2, resident_blocks=0)
        off = make_plan(cfg, Workload(seq=4096, offload_block_inputs=True), hw, window=2, resident_blocks=0)
        c = off.costs
        if exposed:
            assert off.step.total_s >= base.step.total_s + 8 * (c.input_copy_s - c.fwd_s)
        else:
            assert off.step.total_s == base.step.total_s


def test_head_tail_on_host_keeps_compute_precision_weights_on_the_device():
    cfg = GPTConfig(vocab_size=50257, vocab_pad_multiple=128, seq_len=1024, layers=4, hidden=256, heads=4)
    hw = _hw("h100-80gb", host_gib=64, nvme_gib=0)
    dev = block_costs(cfg, Workload(precision="bf16"), hw)
    host = block_costs(cfg, Workload(precision="bf16", head_tail_on_host=True), hw)
    params = dev.head_tail_bytes // 20  # device AdamW layout: 20 B/param in bf16
    assert host.head_tail_bytes == params * 2 * 2 and host.head_tail_fp32_grad_bytes == 0
    assert host.head_tail_host_bytes == params * 16
    assert host.head_tail_update_s > params / 2e9


@pytest.mark.parametrize("seq", [32768, 65536, 131072, 196608])
def test_chosen_settings_fit_and_no_fewer_do(seq):
    """The settings chosen fit, and no proper subset of them does (each costs time or host memory)."""
    cfg = GPTConfig(vocab_size=50257, vocab_pad_multiple=128, seq_len=seq, layers=24, hidden=2048, heads=16)
    work, hw = Workload(), _hw("rtx4090", host_gib=128, nvme_gib=0)
    chosen = choose_sequence_settings(cfg, work, hw, seq)
    assert chosen.fits and plan_sequence(cfg, work, hw, chosen).fits
    names = chosen.chosen
    for size in range(len(names)):
        for on in itertools.combinations(names, size):
            fewer = SequenceSettings(
                seq=seq, loss_chunk_tokens=chosen.loss_chunk_tokens if "loss_chunk" in on else 0,
                mlp_tile_tokens=chosen.mlp_tile_tokens if "mlp_tile" in on else 0,
                head_tail_on_host="head_tail_host" in on, offload_block_inputs="offload_inputs" in on)
            assert not plan_sequence(cfg, work, hw, fewer).fits, on
    # this 1.3B model fits its 24 GB at 32K as it is; longer, it needs more and more settings
    assert len(names) == {32768: 0, 65536: 1, 131072: 2, 196608: 3}[seq]


def test_settings_not_free_keep_their_values_and_the_free_ones_are_chosen():
    """``free`` names what may change: the chunked loss the caller left off stays off, and the
    fewest of the free settings that fit beside it are chosen (here it takes more of them than
    the free choice of all four, which turns the chunked loss on)."""
    seq = 131072
    cfg = GPTConfig(vocab_size=50257, vocab_pad_multiple=128, seq_len=seq, layers=24, hidden=2048, heads=16)
    hw = _hw("rtx4090", host_gib=128, nvme_gib=0)
    work = Workload(loss_chunk_tokens=0)
    anything = choose_sequence_settings(cfg, work, hw, seq)
    fixed = choose_sequence_settings(cfg, work, hw, seq, free=("head_tail_host", "offload_inputs"))
    assert "loss_chunk" in anything.chosen and anything.fits
    assert fixed.loss_chunk_tokens == 0 and fixed.mlp_tile_tokens == 0
    assert set(fixed.chosen) <= {"head_tail_host", "offload_inputs"}
    assert fixed.fits == plan_sequence(cfg, work, hw, fixed).fits
    if fixed.fits:  # nothing fewer of the free ones fits
        for on in itertools.combinations(fixed.chosen, len(fixed.chosen) - 1):
            fewer = dataclasses.replace(fixed, head_tail_on_host="head_tail_host" in on,
                                        offload_block_inputs="offload_inputs" in on)
            assert not plan_sequence(cfg, work, hw, fewer).fits
    with pytest.raises(ValueError, match="not among"):
        choose_sequence_settings(cfg, work, hw, seq, free=("loss",))


def test_nothing_fits_reports_every_setting_and_fits_false():
    cfg = GPTConfig(vocab_size=256, seq_len=1 << 20, layers=4, hidden=4096, heads=32)
    got = choose_sequence_settings(cfg, Workload(), _hw("rtx4090", host_gib=64, nvme_gib=0), 1 << 20)
    assert not got.fits and got.chosen == SETTINGS


def test_longest_context_grows_with_device_memory_and_is_the_edge():
    """More device memory never shortens the longest context; it fits and one granule more does not."""
    cfg = GPTConfig(vocab_size=50257, vocab_pad_multiple=128, seq_len=2048, layers=24, hidden=2048, heads=16)
    work = Workload()
    previous = 0
    for gib in (16, 24, 40, 80):
        hw = _hw("rtx4090", host_gib=256, nvme_gib=0)
        hw.gpu.memory_bytes = gib * GiB
        got = longest_context(cfg, work, hw)
        assert got.seq >= previous and got.plan.fits
        previous = got.seq
        longer = got.seq + 1024
        everything = SequenceSettings(seq=longer, loss_chunk_tokens=loss_chunk_for(cfg, work, longer),
                                      mlp_tile_tokens=mlp_tile_for(cfg, work, longer),
                                      head_tail_on_host=True, offload_block_inputs=True)
        assert not plan_sequence(cfg, work, hw, everything).fits
    assert previous > 0


# ---- the goals, as planner outputs

@pytest.fixture(scope="module")
def llama8b():
    pytest.importorskip("transformers")
    from pystronghold.planner.hf_shape import read_hf_shape

    return read_hf_shape(str(MODELS / "llama-3-8b"))


@pytest.fixture(scope="module")
def llama70b():
    pytest.importorskip("transformers")
    from pystronghold.planner.hf_shape import read_hf_shape

    return read_hf_shape(str(MODELS / "llama-3-70b"))


def test_8b_at_128k_fits_one_h100(llama8b):
    """`train --model hf:DIR --seq 131072` for an 8B Llama shape (128K vocabulary, bf16, 125 GiB host,
    NVMe): the planner says it fits one H100, with a step time, with the loss over chunks that is
    the default; with the full logits and no other setting it does not."""
    hw = _hw("h100-80gb")
    assert make_plan(llama8b, Workload(seq=131072), hw).fits
    assert not make_plan(llama8b, Workload(seq=131072, loss_chunk_tokens=0), hw).fits
    chosen = choose_sequence_settings(llama8b, Workload(), hw, 131072)
    plan = plan_sequence(llama8b, Workload(), hw, chosen)
    assert chosen.fits and plan.fits and plan.step.total_s > 0
    assert "loss_chunk" in chosen.chosen


@pytest.mark.parametrize("gpu, goal", [("h100-80gb", 512 * K), ("h200-141gb", 1024 * K)])
def test_8b_full_fine_tune_longest_context_meets_the_goal(llama8b, gpu, goal):
    got = longest_context(llama8b, Workload(), _hw(gpu))
    assert got.seq >= goal and got.plan.fits and got.plan.step.total_s > 0


@pytest.mark.parametrize("gpu, goal", [("h100-80gb", 256 * K), ("h200-141gb", 512 * K)])
def test_70b_lora_longest_context(llama70b, gpu, goal):
    got = longest_context(llama70b, Workload(finetune=FinetuneOptions(lora_rank=16)), _hw(gpu))
    assert got.seq >= goal and got.plan.fits and got.plan.step.total_s > 0


def test_plan_says_the_settings_and_the_longest_context(capsys):
    """`plan` at 128K for the 8B shape on an H100: it fits (exit 0) with the default chunked loss
    alone (no setting line), and reports the longest context with its step time; --json carries
    the same, the chunk as --loss-chunk auto takes it."""
    pytest.importorskip("transformers")
    from pystronghold.cli import main

    args = ["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--nvme", "2000", "--precision", "bf16",
            "--model", f"hf:{MODELS / 'llama-3-8b'}", "--seq", "131072"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokens need:" not in out
    line = next(x for x in out.splitlines() if x.startswith("longest context: "))
    assert "block inputs offloaded" in line and "tokens/s" in line
    assert main([*args, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    longest = record["sequence"]["longest"]
    assert longest["seq"] >= 512 * K and longest["step_s"] > 0
    assert record["sequence"]["settings"]["loss_chunk_tokens"] == 512
