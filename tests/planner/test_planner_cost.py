"""Cost model formulas against the model code and the published formulas they generalise."""

import dataclasses

import pytest
import torch

from pystronghold.models import GPT, PRESETS, GPTConfig, block_param_count
from pystronghold.planner.cost import (Workload, analytic_window, block_activation_bytes, block_costs,
                                       block_forward_flops, block_param_numels, block_params_per_rank,
                                       head_tail_params_per_rank, host_bytes_per_param, slot_bytes,
                                       tail_activation_bytes)
from pystronghold.planner.hardware import GPU, GPUS, GiB, Hardware, gpu_preset
from pystronghold.runtime.prepare import slot_bytes as prepare_slot_bytes
from pystronghold.runtime.memory.store import BlockLayout
from runtime_models import saved_activation_bytes


@pytest.mark.parametrize("name", ["tiny", "small", "gpt3-1.3b", "gpt3-175b"])
def test_block_params_match_the_model_presets(name):
    cfg = PRESETS[name]
    assert block_params_per_rank(cfg) == block_param_count(cfg)


def test_block_and_head_tail_params_match_a_built_model():
    cfg = GPTConfig(vocab_size=97, seq_len=16, layers=2, hidden=32, heads=4, tie_embeddings=False)
    model = GPT(cfg)
    assert block_params_per_rank(cfg) == sum(p.numel() for p in model.blocks[0].parameters())
    head_tail = sum(p.numel() for p in model.head.parameters()) + sum(p.numel() for p in model.tail.parameters())
    assert head_tail_params_per_rank(cfg) == head_tail


@pytest.mark.parametrize("bias", [True, False])
def test_param_numels_follow_the_block_and_the_runtime_layout(bias):
    cfg = GPTConfig(vocab_size=97, seq_len=16, layers=1, hidden=40, heads=4, bias=bias)
    block = GPT(cfg).blocks[0]
    assert block_param_numels(cfg) == [p.numel() for p in block.parameters()]
    offset = 0  # the runtime's layout: 16-element offsets, buffers rounded to 4096 bytes
    for p in block.parameters():
        offset = (offset + 15) // 16 * 16 + p.numel()
    numel = (offset + 15) // 16 * 16
    assert slot_bytes(cfg, "bf16") == 2 * ((numel * 2 + 4095) // 4096 * 4096)
    # ... and what the runtime sizes its window slots with for this very block
    runtime_slot = prepare_slot_bytes([BlockLayout(list(block.named_parameters()))], torch.bfloat16)
    assert slot_bytes(cfg, "bf16") == runtime_slot


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_split_matches_the_models_count(tp):
    cfg = dataclasses.replace(PRESETS["gpt3-1.3b"], tp_size=tp)
    assert block_params_per_rank(cfg) == block_param_count(cfg, per_tp_rank=True)
    C = cfg.hidden
    replicated = 2 * (2 * C) + C + C  # two LayerNorms (weight, bias) and the row-parallel biases
    assert block_params_per_rank(cfg) == replicated + (block_param_count(cfg) - replicated) // tp


def test_forward_flops_is_the_gpt_formula():
    cfg = PRESETS["gpt3-6.7b"]
    B, T, C = 3, 1024, cfg.hidden
    assert block_forward_flops(cfg, B, T) == 24 * B * T * C * C + 4 * B * T * T * C


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activations_reduce_to_korthikanti(tp):
    # Korthikanti et al. 2022, eq. (2) and tensor-parallel form: s*b*h*(10 + 24/t + 5*a*s/(h*t)),
    # 16-bit activations, dropout masks kept, attention scores materialised.
    cfg = GPTConfig(vocab_size=256, seq_len=512, layers=2, hidden=1024, heads=16, tp_size=tp)
    work = Workload(batch=2, precision="bf16", flash_attention=False, dropout=True)
    s, b, h, a, t = 512, 2, 1024, 16, tp
    assert block_activation_bytes(cfg, work, s) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


def test_activations_with_fused_attention_and_fp32():
    cfg = GPTConfig(vocab_size=256, seq_len=128, layers=2, hidden=64, heads=4)
    work = Workload(batch=3, precision="fp32")
    btc = 3 * 128 * 64
    assert block_activation_bytes(cfg, work, 128) == 16 * btc * 4  # 16 (B,T,C)-sized tensors, 4 bytes


def test_host_store_is_16_bytes_per_param():
    assert {p: host_bytes_per_param(p) for p in ("fp32", "bf16", "fp16")} == {"fp32": 16, "bf16": 16, "fp16": 16}


def test_block_costs_bytes_and_times():
    cfg = PRESETS["gpt3-1.3b"]
    hw = Hardware(gpu=gpu_preset("a100-80gb"), host_memory_bytes=512 * GiB, cpu_adam_params_per_s=1e9)
    work = Workload(batch=2, precision="bf16", compute_efficiency=0.5)
    c = block_costs(cfg, work, hw)
    p = block_param_count(cfg)
    assert 0 <= c.slot_bytes - 2 * p * 2 < 2 * (4096 + 12 * 16 * 2)  # alignment padding only
    assert c.load_s == pytest.approx(p * 2 / 25e9)
    assert c.fwd_s == pytest.approx(block_forward_flops(cfg, 2, 2048) / (312e12 * 0.5))
    assert c.bwd_s == pytest.approx(3 * c.fwd_s)  # 2x backward + 1x recompute
    assert c.adam_s == pytest.approx(p / 1e9)
    assert c.head_tail_bytes == head_tail_params_per_rank(cfg) * 20  # bf16 params+grads, fp32 master+grad, moments
    no_ckpt = block_costs(cfg, dataclasses.replace(work, checkpointing=False), hw)
    assert no_ckpt.bwd_s == pytest.approx(2 * c.fwd_s)
    fp32 = block_costs(cfg, dataclasses.replace(work, precision="fp32"), hw)
    assert fp32.head_tail_bytes == head_tail_params_per_rank(cfg) * 16


def test_analytic_window_is_the_closed_form_and_grows_on_a_slow_link():
    cfg = PRESETS["gpt3-1.3b"]
    slow_link = Hardware(gpu=dataclasses.replace(gpu_preset("h100-80gb"), h2d_bytes_per_s=1e9),
                         host_memory_bytes=512 * GiB)
    c = block_costs(cfg, Workload(batch=1), slow_link)
    assert analytic_window(c) == max(2, 1 + -(-c.load_s // c.fwd_s))
    assert analytic_window(c) > 2


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="Workload.batch"):
        Workload(batch=0)
    with pytest.raises(ValueError, match="Workload.precision"):
        Workload(precision="fp8")
    with pytest.raises(ValueError, match="GPU.memory_bytes"):
        dataclasses.replace(GPUS["rtx4090"], memory_bytes=-1)
    with pytest.raises(ValueError, match="Hardware.host_memory_bytes"):
        Hardware(gpu=gpu_preset("rtx3090"), host_memory_bytes=0)
    with pytest.raises(ValueError, match="unknown GPU 'b300'"):
        gpu_preset("b300")
    with pytest.raises(ValueError, match="no bf16"):
        block_costs(PRESETS["tiny"], Workload(precision="bf16"),
                    Hardware(gpu=gpu_preset("v100-32gb"), host_memory_bytes=GiB))
    with pytest.raises(ValueError, match="seq"):
        block_costs(PRESETS["tiny"], Workload(seq=65), Hardware(gpu=gpu_preset("rtx3090"), host_memory_bytes=GiB))


def test_presets_are_consistent():
    for name, gpu in GPUS.items():
        assert isinstance(gpu, GPU) and gpu.name == name
        assert gpu.fp16_flops > gpu.fp32_flops


def test_activation_formula_matches_what_autograd_saves():
    # the bytes a real Block keeps for backward (fp32, fused SDPA on CPU), counted by storage:
    # the 16 (B, T, C) tensors of the formula, plus LayerNorm statistics and the attention
    # log-sum-exp that the formula leaves out (< 1%)
    import torch

    cfg = GPTConfig(vocab_size=256, seq_len=128, layers=1, hidden=64, heads=4)
    block = GPT(cfg).blocks[0]
    x = torch.randn(4, 128, 64, requires_grad=True)
    measured = saved_activation_bytes(block, x)
    predicted = block_activation_bytes(cfg, Workload(batch=4, precision="fp32"), 128)
    assert predicted <= measured <= 1.02 * predicted


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_loss_holds_only_this_ranks_logits_in_compute_precision(tp):
    # the vocab-parallel cross-entropy: logits shard, its gradient (written in forward), the scaled
    # gradient; no gathered (B, T, V) logits, no fp32 copy (the old term was B*T*V*(s + 12))
    cfg = GPTConfig(vocab_size=1000, vocab_pad_multiple=128, seq_len=64, layers=2, hidden=64, heads=4, tp_size=tp)
    work = Workload(batch=3, precision="bf16")
    assert tail_activation_bytes(cfg, work, 64) == 3 * 3 * 64 * (1024 // tp) * 2 + 2 * 3 * 64 * 64 * 2
