"""LoRA and frozen parameters in the planner: bytes by hand, adapter counts against PEFT, the
largest LoRA model, the Llama-70B-on-one-H100 plan, and one-line errors."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from pystronghold.cli import main
from pystronghold.models import PRESETS, GPTConfig
from pystronghold.planner import Hardware, Workload, gpu_preset, largest_models, make_plan
from pystronghold.planner.cost import block_costs
from pystronghold.planner.hardware import GiB
from pystronghold.planner.trainable import param_split
from pystronghold.runtime.memory.placement import plan_placement
from pystronghold.settings.finetune import FinetuneOptions

from hf_models import FAMILIES, save_tiny

LLAMA_70B = Path(__file__).resolve().parents[2] / "bench" / "models" / "llama-3-70b"

# Every parameter a multiple of 2048 elements (C = 1024, no biases: norms 2C, matrices 12C^2), so
# every fp32 and bf16 buffer is whole 4096-byte pages and the bytes per parameter come out exact.
WIDE = GPTConfig(vocab_size=2048, seq_len=64, layers=3, hidden=1024, heads=8, bias=False)
P_B = 2 * 1024 + 12 * 1024 * 1024  # parameters of one block
QKV_ADAPTERS = 16 * 1024 + 3 * 1024 * 16  # LoRA r=16 on attn.qkv (3C x C): A 16 x C, B 3C x 16


def hw(host_gib=64, nvme_gib=0, gpu="h100-80gb"):
    return Hardware(gpu=gpu_preset(gpu), host_memory_bytes=host_gib * GiB, nvme_bytes=nvme_gib * GiB)


def store_bytes(cfg, finetune, precision="bf16"):
    """Host store bytes of every block streamed (K = 0)."""
    work = Workload(batch=1, seq=64, precision=precision, finetune=finetune)
    plan = make_plan(cfg, work, hw(), resident_blocks=0)
    return plan.host.host_bytes - work.host_reserve_bytes, plan


@pytest.mark.parametrize("precision,frozen_bytes", [("bf16", 2), ("fp32", 4)])
def test_frozen_parameters_cost_their_compute_dtype_bytes_and_trainable_ones_16(precision, frozen_bytes):
    full, _ = store_bytes(WIDE, FinetuneOptions(), precision)
    assert full == 3 * 16 * P_B  # fp32 master and two moments, grad and (bf16) shadow
    frozen, plan = store_bytes(WIDE, FinetuneOptions(freeze=r"^blocks\."), precision)
    assert frozen == 3 * frozen_bytes * P_B  # the value once, in the compute dtype
    c = plan.costs
    assert c.block_frozen_params == P_B and c.grad_s == 0 and c.adam_s == 0 and c.allreduce_s == 0
    assert c.slot_bytes == frozen_bytes * P_B  # no gradient buffer
    assert c.resident_block_bytes == frozen_bytes * P_B
    full_costs = block_costs(WIDE, Workload(batch=1, seq=64, precision=precision), hw())
    assert c.load_s == full_costs.load_s and c.fwd_s == full_costs.fwd_s
    assert c.bwd_s < full_costs.bwd_s  # no weight gradients of the frozen matrices


def test_lora_store_is_2_bytes_per_base_param_and_16_per_adapter():
    lora, plan = store_bytes(WIDE, FinetuneOptions(lora_rank=16))
    assert lora == 3 * (2 * (P_B + QKV_ADAPTERS) + 14 * QKV_ADAPTERS)  # shadow of all + states of the adapters
    c = plan.costs
    assert c.block_params == P_B + QKV_ADAPTERS and c.block_frozen_params == P_B
    assert c.slot_bytes == 2 * (P_B + QKV_ADAPTERS) + 2 * QKV_ADAPTERS
    head_tail = 2048 * 1024 + 64 * 1024 + 1024 + 2048 * 1024  # tok, pos, ln_f, lm_head: all frozen
    assert c.head_tail_bytes == 2 * head_tail
    assert plan.trainable_params == 3 * QKV_ADAPTERS and plan.frozen_params == 3 * P_B + head_tail
    assert c.grad_s == pytest.approx(2 * QKV_ADAPTERS / plan.hardware.gpu.d2h_bytes_per_s)


def test_freeze_attention_by_name_on_a_gpt():
    cfg = PRESETS["tiny"]  # C = 64 with biases
    split = param_split(cfg, FinetuneOptions(freeze=r"\.attn\."))
    C = 64
    assert split.block_frozen == (3 * C * C, 3 * C, C * C, C)  # qkv and proj, weights and biases
    assert sum(split.block_trainable) == 4 * C + 2 * 4 * C * C + 4 * C + C  # norms, fc1, fc2
    assert split.block_frozen_matmul == 4 * C * C and split.head_tail_frozen == 0


def test_frozen_weights_go_to_disk_last():
    """A LoRA-like store larger than the host: the adapters' states go to disk first, then the
    frozen weights (the shadow) of the last blocks, which every load then reads from disk."""
    numels, train = [1 << 22] * 8, [1 << 12] * 8  # 8 MiB of bf16 weights, 4096 trainable elements
    p = plan_placement(numels, torch.bfloat16, train_numels=train, budget_bytes=41 << 20, nvme=True,
                       cache_blocks=1)
    assert p.disk_blocks["shadow"] == (4, 5, 6, 7)  # 4 blocks of 8 MiB in host memory, 1 staged
    assert set(p.disk_blocks) == {"master", "exp_avg", "exp_avg_sq", "grad", "shadow"}


# ---- LoRA against PEFT


def _hf_dir(tmp_path, model) -> str:
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp_path)  # config.json only: nothing else is read
    return str(tmp_path)


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=96,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=97, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def test_lora_adapters_counted_by_hand_on_the_llama_70b_shape():
    pytest.importorskip("transformers")
    from pystronghold.planner.hf_shape import read_hf_shape

    shape = read_hf_shape(str(LLAMA_70B))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.mlp_width) == (80, 8192, 64, 8, 28672)
    split = param_split(shape, FinetuneOptions(lora_rank=16))
    # q_proj 8192 -> 8192 and v_proj 8192 -> 8 x 128: r * (in + out) each
    assert split.block_adapters == 16 * (8192 + 8192) + 16 * (8192 + 1024)
    base_block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # q, o; k, v; MLP; norms
    assert sum(split.block_frozen) == base_block
    assert split.head_tail_frozen == 2 * 128256 * 8192 + 8192 and split.head_tail_trainable == 0


@pytest.mark.parametrize("make,targets", [(_tiny_llama, None), (_tiny_llama, ("q_proj", "v_proj", "down_proj")),
                                          (_tiny_llama, ("self_attn.o_proj", "lm_head")), (_tiny_gpt2, None),
                                          (_tiny_gpt2, ("c_attn", "c_fc"))])
def test_lora_counts_and_layout_are_peft_s(tmp_path, make, targets):
    peft = pytest.importorskip("peft")
    from pystronghold.planner.hf_shape import read_hf_shape

    model = make()
    shape = read_hf_shape(_hf_dir(tmp_path, model))
    finetune = FinetuneOptions(lora_rank=4, lora_targets=targets)
    plan = make_plan(shape, Workload(batch=1, seq=16, finetune=finetune), hw())
    config = peft.LoraConfig(r=4, target_modules=list(targets) if targets else None,
                             fan_in_fan_out=shape.fan_in_fan_out)  # GPT-2's Conv1D weights are (in, out)
    peft_model = peft.get_peft_model(model, config)
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert (plan.trainable_params, plan.params + plan.trainable_params) == (trainable, total)
    # one block as the runtime lays it out: trainable parameters first, then the frozen ones
    block = list(peft_model.get_submodule(f"base_model.model.{shape.blocks_name}")[0].parameters())
    split = param_split(shape, finetune)
    assert split.block_trainable == tuple(p.numel() for p in block if p.requires_grad)
    assert split.block_frozen == tuple(p.numel() for p in block if not p.requires_grad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_has_default_lora_targets_the_planner_and_training_agree_on(tmp_path, family):
    """The planner's default targets are those training resolves (PEFT's for the family, else the
    attention's query and value projections found by name), for every family the zoo loads."""
    pytest.importorskip("peft")
    from pystronghold.models.hf import load_lazy
    from pystronghold.models.lora import add_lora
    from pystronghold.planner.hf_shape import read_hf_shape
    from pystronghold.planner.trainable import lora_targets
    from pystronghold.settings.finetune import LoraSpec

    directory = save_tiny(tmp_path, family, tokenizer=False)
    planned = lora_targets(read_hf_shape(str(directory)), FinetuneOptions(lora_rank=4))
    _, trained = add_lora(load_lazy(directory), LoraSpec(rank=4, alpha=8), seed=0)
    assert planned and set(planned) == set(trained.targets)


def test_hf_shape_matches_the_built_model(tmp_path):
    from pystronghold.planner.hf_shape import read_hf_shape
    from pystronghold.planner.params import model_params

    model = _tiny_llama()
    shape = read_hf_shape(_hf_dir(tmp_path, model))
    assert [s for _, s in shape.block_params] == [tuple(p.shape) for p in model.model.layers[0].parameters()]
    assert model_params(shape) == sum(p.numel() for p in model.parameters())


# ---- the largest model, the 70B plan, the CLI

def test_the_largest_lora_model_is_larger_than_the_largest_full_fine_tune():
    work = Workload(batch=1, seq=1024)
    machine = hw(host_gib=64, gpu="rtx4090")
    full = largest_models(PRESETS["gpt3-1.3b"], work, machine, widths=[2048])[0]
    lora = largest_models(PRESETS["gpt3-1.3b"], dataclasses.replace(work, finetune=FinetuneOptions(lora_rank=8)),
                          machine, widths=[2048])[0]
    assert full.bound == "host" and lora.layers > 5 * full.layers and lora.params > 5 * full.params
    assert make_plan(dataclasses.replace(PRESETS["gpt3-1.3b"], layers=lora.layers),
                     dataclasses.replace(work, finetune=FinetuneOptions(lora_rank=8)), machine).fits


def test_llama_70b_lora_on_one_h100_is_planned(capsys):
    pytest.importorskip("transformers")
    base = ["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--nvme", "2000", "--model", f"hf:{LLAMA_70B}",
            "--seq", "4096", "--precision", "bf16"]
    assert main(base + ["--lora-rank", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ft = out["finetune"]
    assert out["fits"] and out["model"]["params"] == 70_553_706_496
    assert ft["trainable_params"] == 80 * 16 * (2 * 8192 + 8192 + 1024) and ft["lora_targets"] == ["q_proj", "v_proj"]
    assert ft["frozen_host_bytes"] + ft["frozen_disk_bytes"] + ft["frozen_device_bytes"] == 2 * ft["frozen_params"]
    assert out["step"]["total_s"] > 0 and out["largest"][0]["params"] > out["model"]["params"]
    assert out["schedule"]["estimates"]["default"]["d2h_bytes"] < GiB  # only the adapters' gradients leave
    assert main(base + ["--lora-rank", "16"]) == 0
    text = capsys.readouterr().out
    assert "trains    LoRA r=16 on q_proj,v_proj: 32.8 M trainable" in text and "frozen    2 B/param" in text
    assert main(base + ["--json"]) == 0  # the full fine-tune fits with the NVMe tier, far slower
    full = json.loads(capsys.readouterr().out)
    assert full["step"]["total_s"] > 20 * out["step"]["total_s"]


def test_llama_70b_lora_fits_one_h100_and_125_gib_without_nvme(capsys):
    """The host store holds the N - K streamed blocks only, so the verdict is theirs: 80 blocks in
    bf16 (128 GiB) would not fit 125 GiB, the 50 streamed beside 30 resident (80 GiB) do. The
    report names one host store, and the frozen bytes as a part of it."""
    pytest.importorskip("transformers")
    rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "125", "--model", f"hf:{LLAMA_70B}", "--seq", "4096",
               "--precision", "bf16", "--lora-rank", "16"])
    text = capsys.readouterr().out
    assert rc == 0 and "DOES NOT FIT" not in text and "TOO BIG" not in text
    streamed = re.search(r"streamed  (\d+) blocks through W=\d+ slots: [\d.]+ GiB on the device, ([\d.]+) GiB host "
                         r"store", text)
    frozen = re.search(r"no gradient: ([\d.]+) GiB of the host store", text)
    host = re.search(r"\nhost +([\d.]+) GiB .* \+ 8.0 GiB reserve, of 125.0 GiB\n", text)
    assert streamed and frozen and host, text
    blocks, store = int(streamed[1]), float(streamed[2])
    assert 0 < blocks < 80 and float(frozen[1]) <= store == pytest.approx(float(host[1]) - 8.0, abs=0.1)
    assert text.count("host store") == 2  # the streamed blocks' store, and the frozen part of it


def test_resident_blocks_leave_no_disk_cost_on_a_store_that_then_fits_the_host():
    """The store of the streamed blocks only (N - K) decides the tier the host updates pay for: a
    model whose N blocks would spill to NVMe but whose N - K streamed ones fit the host has no
    disk time in its step."""
    cfg = dataclasses.replace(PRESETS["gpt3-1.3b"], layers=40)
    plan = make_plan(cfg, Workload(batch=1, seq=1024), hw(host_gib=16, nvme_gib=1000, gpu="a100-80gb"))
    assert plan.fits and plan.resident_blocks > 0 and plan.host.tier == "host"
    assert plan.costs.adam_s == pytest.approx(plan.costs.block_params / plan.hardware.cpu_adam_params_per_s)


@pytest.mark.parametrize("args,message", [
    (["--lora-rank", "0"], "--lora-rank 0 must be a positive integer"),
    (["--lora-rank", "-2"], "--lora-rank -2 must be a positive integer"),
    (["--lora-rank", "8", "--lora-targets", "q_proj"], "--lora-targets: 'q_proj' names no module of the model; "
                                                       "its linear layers: fc1, fc2, pos, proj, qkv"),
    (["--lora-rank", "8", "--lora-targets", "ln1"], "'ln1' is not a linear layer"),
    (["--lora-targets", "qkv"], "--lora-targets needs --lora-rank"),
    (["--lora-rank", "8", "--freeze", "attn"], "--freeze and --lora-rank exclude each other"),
    (["--freeze", "("], "--freeze is not a regular expression"),
    (["--freeze", r"blocks\.0\."], "freezes 12 of block 0's 12 parameters but 0 of block 1's"),
    (["--freeze", "nothing"], "--freeze 'nothing' matches no parameter"),
    (["--lora-rank", "8", "--tp", "2"], "tensor parallelism 1 only"),
    (["--model", "hf:/no/such/dir", "--lora-rank", "8"], "--model hf:/no/such/dir: no such directory"),
    (["--model", f"hf:{LLAMA_70B}", "--hidden", "4096"], "--hidden does not apply to a Hugging Face model"),
])
def test_cli_fine_tune_errors_are_one_line(args, message, capsys):
    try:
        model = [] if "--model" in args else ["--model", "gpt3-1.3b", "--widths", "2048"]
        rc = main(["plan", "--gpu", "h100-80gb", "--host-memory", "64", *model, *args])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_help_says_the_default_lora_targets(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Default: PEFT's for the family (q_proj,v_proj for Llama" in out and "--lora-rank R" in out and "--freeze REGEX" in out
