"""``pystronghold plan --model hf:DIR`` at --tp, --pp and --dp, and across nodes with --cluster: a
Hugging Face model's per-rank shapes split as ``models.hf_tp`` splits them, its stages as
``pipelining/hf.py`` cuts them, its link bytes, and a 70B Llama over 2 nodes x 8 GPUs."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from pystronghold.cli import main
from pystronghold.models.gpt import GPTConfig
from pystronghold.planner import Hardware, gpu_preset
from pystronghold.planner.cost import (Workload, block_activation_bytes, block_costs, block_forward_flops,
                                       block_params_per_rank, head_tail_params_per_rank)
from pystronghold.planner.trainable import param_split
from pystronghold.planner.pipeline import even_split, link_bytes, plan_pipeline, stage_split
from pystronghold.settings.finetune import FinetuneOptions

transformers = pytest.importorskip("transformers")

HW = Hardware(gpu=gpu_preset("h100-80gb"), host_memory_bytes=64 << 30, cpu_adam_params_per_s=1e9)

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192,
             "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
"""Llama 3 70B's config.json (the shape; no weights are read)."""


def _shape(config, tp: int = 1):
    from pystronghold.planner.hf_shape import hf_shape_from_config

    shape = hf_shape_from_config(config, source="tiny", architecture=config.model_type)
    return dataclasses.replace(shape, tp_size=tp)


def _llama(**overrides):
    kw = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**kw, **overrides})


def _hf_dir(tmp_path, config: dict) -> str:
    directory = tmp_path / "llama-3-70b"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_gpt_neox_block_at_tp2_costs_what_the_same_shaped_gpt_block_does():
    """GPT-NeoX's block is our GPT's (fused QKV, biases, LayerNorms, a 4C MLP): split over 2 ranks by
    its family's plan it has the GPT's per-rank parameters, FLOPs, activations and seconds."""
    neox = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                      num_hidden_layers=4, vocab_size=256, max_position_embeddings=64)
    hf = _shape(neox, tp=2)
    gpt = GPTConfig(vocab_size=256, seq_len=64, layers=4, hidden=64, heads=4, tp_size=2)
    work = Workload(batch=2, seq=64, precision="bf16", dp_size=2)
    assert block_params_per_rank(hf) == block_params_per_rank(gpt) == (block_params_per_rank(_shape(neox)) + 6 * 64) // 2  # norms, row biases whole
    assert block_forward_flops(hf, 2, 64) == block_forward_flops(gpt, 2, 64)
    assert block_activation_bytes(hf, work, 64) == block_activation_bytes(gpt, work, 64)
    hf_costs, gpt_costs = block_costs(hf, work, HW), block_costs(gpt, work, HW)
    for name in ("block_params", "fwd_s", "bwd_s", "load_s", "grad_s", "allreduce_s", "adam_s", "head_tail_s"):
        assert getattr(hf_costs, name) == pytest.approx(getattr(gpt_costs, name)), name
    # the same head and tail but the GPT's position table (NeoX is rotary), vocabulary split alike
    assert head_tail_params_per_rank(hf) == head_tail_params_per_rank(gpt) - 64 * 64
    assert link_bytes(hf, work).tp == link_bytes(gpt, work).tp > 0


def test_a_phi3_block_at_tp2_splits_its_packed_projections():
    """Phi-3's packed qkv_proj and gate_up_proj (``colwise_gather_output``) split by rows and its
    o_proj and down_proj (``rowwise_split_input``) by columns, as ``models.hf_tp`` splits them: every
    matrix halves, the two norms stay whole."""
    phi3 = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, num_hidden_layers=4, vocab_size=128,
                                   max_position_embeddings=64, pad_token_id=0)
    assert block_params_per_rank(_shape(phi3, tp=2)) == (block_params_per_rank(_shape(phi3)) - 2 * 64) // 2 + 2 * 64


def test_lora_adapters_at_tp2_are_sharded_with_their_base_layer():
    """A colwise q_proj keeps A whole and splits B's rows; a rowwise o_proj splits A's columns and
    keeps B whole (Megatron's LoRA); the frozen base is one rank's half of the matrices."""
    llama = _llama()
    targets = ("q_proj", "o_proj")
    whole = param_split(_shape(llama), FinetuneOptions(lora_rank=8, lora_targets=targets))
    split = param_split(_shape(llama, tp=2), FinetuneOptions(lora_rank=8, lora_targets=targets))
    assert whole.block_trainable == (8 * 64, 64 * 8, 8 * 64, 64 * 8)
    assert split.block_trainable == (8 * 64, 32 * 8, 8 * 32, 64 * 8)
    norms = 2 * 64
    assert sum(split.block_frozen) - norms == (sum(whole.block_frozen) - norms) // 2
    assert split.lm_head_frozen and split.head_tail_frozen == 2 * 64 * 64 + 64  # embedding and head halves, norm


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (2, 4)])
def test_stages_split_the_blocks_evenly_and_their_parameters_sum_to_the_model_s(tied, tp, pp):
    """Stages are ``pipelining/hf.py``'s (even block ranges, not the GPT's FLOP balance, which a large
    vocabulary tilts); their parameters add up to the model's on one TP rank, plus the last
    stage's copy of a tied embedding."""
    llama = _llama(num_hidden_layers=8, vocab_size=32768, tie_word_embeddings=tied)
    shape = _shape(llama, tp=tp)
    work = Workload(batch=1, seq=64, precision="bf16")
    pipeline = plan_pipeline(shape, work, pp, pp)
    assert pipeline.split == even_split(8, pp)
    assert pipeline.split != stage_split(shape, 64, pp)[0]  # the LM head's FLOPs would take blocks off the last
    total = 8 * block_params_per_rank(shape) + head_tail_params_per_rank(shape)
    embedding = 32768 // tp * 64
    assert sum(pipeline.stage_params) == total + (embedding if tied else 0)
    assert pipeline.stage_params[0] == len(pipeline.split[0]) * block_params_per_rank(shape) + embedding


def test_link_bytes_of_a_tp_pp_dp_layout():
    """Per rank and step: TP all-reduces of B*T*C*s, four per block and micro-batch and two more for
    a block that recomputes, PP activations and gradients of every micro-batch, the DP ring of the
    trainable gradients."""
    shape = _shape(_llama(num_hidden_layers=8), tp=2)
    work = Workload(batch=2, seq=64, precision="bf16", dp_size=4)
    pipeline = plan_pipeline(shape, work, 2, 4)
    links = link_bytes(shape, work, pipeline)
    activation = 2 * 64 * 64 * 2
    assert links.tp == 4 * 4 * 6 * activation * 2 * (2 - 1) // 2  # 4 micro-batches x 4 blocks x 6
    assert link_bytes(shape, work, pipeline, recomputed_blocks=1).tp == 4 * (4 * 4 + 2) * activation  # one recomputes
    assert links.pp == 2 * 4 * activation
    assert links.dp == 2 * 3 * (4 * block_params_per_rank(shape) + head_tail_params_per_rank(shape)) * 2 // 4
    assert link_bytes(shape, dataclasses.replace(work, dp_size=1)).dp == 0


def _plan(args, capsys):
    try:
        rc = main(["plan", *args])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("tp,name", [(3, "num_attention_heads=64"), (16, "num_key_value_heads=8")])
def test_a_tp_that_does_not_divide_is_train_s_one_line_error(tmp_path, capsys, tp, name):
    from pystronghold.models.hf import read_hf_config
    from pystronghold.models.hf_tp import check_hf_tp

    directory = _hf_dir(tmp_path, LLAMA_70B)
    with pytest.raises(ValueError) as refused:
        check_hf_tp(read_hf_config(directory), tp)
    rc, _, err = _plan(["--gpu", "h100-80gb", "--host-memory", "2000", "--model", f"hf:{directory}",
                        "--tp", str(tp)], capsys)
    assert rc == 2 and err == f"pystronghold plan: error: {refused.value}\n"
    assert f"{name} is not divisible by --tp {tp}" in err


@pytest.mark.parametrize("finetune", [[], ["--lora-rank", "16"]])
def test_70b_at_tp8_pp2_plans_its_stages_and_links(tmp_path, capsys, finetune):
    directory = _hf_dir(tmp_path, LLAMA_70B)
    rc, out, err = _plan(["--gpu", "h100-80gb", "--host-memory", "2000", "--model", f"hf:{directory}",
                          "--tp", "8", "--pp", "2", "--dp", "1", "--seq", "4096", "--precision", "bf16",
                          *finetune, "--json"], capsys)
    assert rc == 0, err
    record = json.loads(out)
    assert record["model"]["tp_size"] == 8 and record["model"]["block_params_per_rank"] == (
        2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) // 8 + 2 * 8192 + (
        16 * (8192 + 8192 // 8) + 16 * (8192 + 1024 // 8) if finetune else 0)  # LoRA: q_proj, v_proj
    assert record["pipeline"]["split"] == [[0, 40], [40, 80]]
    assert record["links"]["tp_bytes"] > 0 and record["links"]["pp_bytes"] == 2 * 2 * 4096 * 8192 * 2
    assert record["links"]["dp_bytes"] == 0
    # 2 micro-batches through 2 stages: the stage's step twice, plus a bubble of (p-1)/m
    assert record["pipeline"]["step_s"] == pytest.approx(2 * record["step"]["total_s"] * 1.5)
    assert record["pipeline"]["tokens_per_s"] == pytest.approx(2 * 4096 / record["pipeline"]["step_s"])


def test_70b_across_2_nodes_x_8_gpus_full_and_lora(tmp_path, capsys):
    """The cluster search over 2 nodes of 8 H100s picks a layout for Llama 3 70B, full and LoRA, and
    says its tokens/s and each GPU's device and host bytes; LoRA runs faster (no host AdamW of the base)."""
    directory = _hf_dir(tmp_path, LLAMA_70B)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"inter_node_gbps": 50, "nodes": [
        {"name": f"node{i}", "host_memory_gib": 2048, "devices": [{"type": "h100-80gb", "count": 8}]}
        for i in range(2)]}))
    common = ["--cluster", str(cluster), "--model", f"hf:{directory}", "--seq", "4096", "--precision", "bf16",
              "--global-batch", "64"]
    rc, out, err = _plan([*common, "--json"], capsys)
    assert rc == 0, err
    record = json.loads(out)
    win = record["ranked"][0]
    assert record["fits"] and win["tp"] * win["pp"] * win["dp"] == 16
    assert record["tokens_per_s"] == pytest.approx(64 * 4096 / win["step_s"])
    assert len(win["device_bytes"]) == len(win["host_bytes"]) == win["pp"]
    assert 0 < max(win["device_bytes"]) <= 80 * 2**30 and min(win["host_bytes"]) > 0
    rc, out, err = _plan([*common, "--lora-rank", "16"], capsys)
    assert rc == 0, err
    found = re.search(r"\n  ([\d,]+) tokens/s \(4096 tokens per sample\); per GPU: device peak [\d.]+ GiB", out)
    assert out.splitlines()[1].startswith("winner: tp ") and found
    assert float(found.group(1).replace(",", "")) > record["tokens_per_s"]
