"""Head and tail trained from host memory (``head_tail_on_host``): the same training as on the device
(bit for bit where the two Adams share torch's arithmetic, ``bitwise_torch``; else the blocks'
stated tolerance), no fp32 master or moment of theirs on the device, the device bytes saved in the
memory report, checkpoints across the option, the "auto" rule and the CLI flag."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.optim.device_adamw import DeviceAdamW
from pystronghold.runtime.memory import layout
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.runtime.optimizer.divergence import DivergenceError
from pystronghold.runtime.optimizer.head_tail import HostHeadTail, head_tail_on_host, host_head_tail_bytes
from runtime_models import HYPER, gpt_batches, one_torch_thread

_threads = pytest.fixture(autouse=True)(one_torch_thread)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def small_gpt(tied: bool = False) -> GPT:
    return GPT(GPTConfig(vocab_size=97, seq_len=32, layers=3, hidden=64, heads=4, tie_embeddings=tied))


def gpt_loss(engine, batch):
    return engine(*batch)


def lm_loss(engine, x):
    return engine(input_ids=x, labels=x).loss


def train(model, batches, *, loss_of=gpt_loss, accumulation=2, bitwise_torch=True, **options):
    """Steps of ``accumulation`` micro-batches through ``wrap``. Returns the losses, every fp32
    master, the optimizer's state dict (copied) and the memory report."""
    engine = ph.wrap(model, optimizer=ph.AdamW(**HYPER, bitwise_torch=bitwise_torch), window=2,
                     accumulation_steps=accumulation, **options)
    try:
        losses = []
        for k, batch in enumerate(batches):
            loss = loss_of(engine, batch)
            engine.backward(loss / accumulation)
            losses.append(loss.item())
            if (k + 1) % accumulation == 0:
                engine.step()
                engine.zero_grad()
        masters = {n: p.clone() for n, p in engine.master_parameters().items()}
        state = copy.deepcopy(engine.optimizer.state_dict())
        return losses, masters, state, engine.memory_report()
    finally:
        engine.close()


def assert_identical(device, host):
    """Losses, masters and optimizer states equal bit for bit."""
    assert host[0] == device[0]
    assert host[1].keys() == device[1].keys()
    for name, value in device[1].items():
        assert torch.equal(host[1][name], value), name
    assert host[2]["state"].keys() == device[2]["state"].keys()
    for i, st in device[2]["state"].items():
        for key, value in st.items():
            assert torch.equal(host[2]["state"][i][key].cpu(), value.cpu()), (i, key)


def both(make_model, batches, **options):
    model = make_model()
    return (train(copy.deepcopy(model), batches, head_tail_on_host=False, **options),
            train(model, batches, head_tail_on_host=True, **options))


# ---- the same training


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_gpt_trains_bit_identically_with_head_and_tail_on_the_host(precision, tied):
    """Clipping and two micro-batches per step (fp16: the loss scale's unscale folded into the same
    host pass); the tied embedding (one parameter in head and tail) has one master and one pair of
    moments."""
    device, host = both(lambda: small_gpt(tied), gpt_batches(8), precision=precision, clip_grad_norm=0.05)
    assert_identical(device, host)
    if tied:  # the LM head is the embedding: saved once
        assert not any("lm_head" in name for name in host[1])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_llama_trains_bit_identically_with_head_and_tail_on_the_host(precision):
    from hf_small import hf_llama, token_batches

    device, host = both(hf_llama, token_batches(6), loss_of=lm_loss, blocks=None, precision=precision,
                        clip_grad_norm=0.5)
    assert_identical(device, host)


def test_param_groups_and_a_head_parameter_without_gradient_follow_torch():
    """decay="matrices" puts the norms' gains in a group without weight decay; a parameter with no
    gradient in a step is not updated and does not count the step (torch's AdamW skips it)."""
    def run(on_host):
        torch.manual_seed(0)
        model = small_gpt()
        engine = ph.wrap(model, optimizer=ph.AdamW(**HYPER, decay="matrices", bitwise_torch=True), window=2,
                         head_tail_on_host=on_host)
        for k, (x, y) in enumerate(gpt_batches(3)):
            engine.backward(engine(x, y))
            if k == 1:
                model.head.pos.weight.grad = None  # as if unused this step
            engine.step()
            engine.zero_grad()
        out = engine.master_parameters(), copy.deepcopy(engine.optimizer.state_dict())
        engine.close()
        return out

    (dev_masters, dev_state), (host_masters, host_state) = run(False), run(True)
    for name, value in dev_masters.items():
        assert torch.equal(host_masters[name], value), name
    assert len(host_state["param_groups"]) == 2
    for i, st in dev_state["state"].items():
        assert float(host_state["state"][i]["step"]) == float(st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(host_state["state"][i][key], st[key]), (i, key)
    assert sorted({float(st["step"]) for st in host_state["state"].values()}) == [2.0, 3.0]


def test_default_host_adam_stays_within_the_blocks_tolerance():
    """Without bitwise_torch the host Adam takes an IEEE square root where CPU torch (the device
    AdamW here) takes MKL's: the blocks' stated tolerance against torch (losses 1e-6 relative,
    parameters 1e-4 absolute, test_runtime_equivalence) holds for head and tail too."""
    device, host = both(small_gpt, gpt_batches(16), accumulation=1, bitwise_torch=False)
    torch.testing.assert_close(torch.tensor(host[0]), torch.tensor(device[0]), rtol=1e-6, atol=0)
    for name, value in device[1].items():
        torch.testing.assert_close(host[1][name], value, rtol=0, atol=1e-4, msg=name)


def test_lora_with_a_saved_lm_head_trains_bit_identically_and_frozen_parameters_get_no_host_state():
    """PEFT LoRA on the Llama with ``modules_to_save=["lm_head"]``: the embedding and the base LM
    head are frozen (no master, moments or host buffers), the LM head's trainable copy trains on
    the host."""
    peft = pytest.importorskip("peft")
    from hf_small import hf_llama, token_batches

    def lora_llama():
        torch.manual_seed(0)
        config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                                 modules_to_save=["lm_head"])
        return peft.get_peft_model(hf_llama(), config)

    model = lora_llama()
    batches = token_batches(4)
    device = train(copy.deepcopy(model), batches, loss_of=lm_loss, blocks=None, head_tail_on_host=False)
    engine = ph.wrap(lora_llama(), window=2, head_tail_on_host=True)
    host_opt = engine.device_optimizer
    frozen = [p for p in engine.head_tail_params if not p.requires_grad]
    trainable = [p for p in engine.head_tail_params if p.requires_grad]
    assert frozen and trainable and len(host_opt.params) == len(trainable)
    assert all(all(p is not q for q in host_opt.params) for p in frozen)
    assert host_opt.host_bytes == host_head_tail_bytes([p.numel() for p in trainable], torch.float32)
    engine.close()
    host = train(model, batches, loss_of=lm_loss, blocks=None, head_tail_on_host=True)
    assert_identical(device, host)


# ---- where the bytes are


def _in(t: torch.Tensor, span: tuple[int, int]) -> bool:
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return span[0] <= start and start + t.nbytes <= span[1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_fp32_master_or_moment_of_head_and_tail_is_outside_the_host_arena(precision):
    """Every master and moment of head and tail lies in the host arena, apart from the parameters
    the model computes with; the device (here the CPU backend) keeps those in the compute dtype."""
    model = small_gpt()
    engine = ph.wrap(model, window=2, precision=precision, head_tail_on_host=True)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    opt = engine.device_optimizer
    assert isinstance(opt, HostHeadTail) and not isinstance(opt, DeviceAdamW)
    span = opt.arena_range()
    states = [t for i in range(len(opt.params)) for t in opt.state_of(i).values() if t.dim() > 0]
    assert len(states) == 2 * len(opt.params) and len(opt.masters) == len(opt.params)
    for t in [*states, *opt.masters]:
        assert t.dtype == torch.float32 and _in(t, span)
    for p in engine.head_tail_params:
        assert p.dtype == DTYPES[precision] and not _in(p, span)
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_masters_and_moments_are_pinned_host_tensors():
    model = small_gpt()
    engine = ph.wrap(model, window=2, device="cuda", precision="bf16", head_tail_on_host=True)
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    opt = engine.device_optimizer
    assert opt.pinned
    for i, p in enumerate(opt.params):
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16
        for t in [opt.masters[i], opt.state_of(i)["exp_avg"], opt.state_of(i)["exp_avg_sq"]]:
            assert t.device.type == "cpu" and t.is_pinned()
    engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_report_shows_the_device_bytes_saved(precision):
    dtype = DTYPES[precision]
    reports = {}
    for on_host in (False, True):
        engine = ph.wrap(small_gpt(), window=2, precision=precision, head_tail_on_host=on_host)
        reports[on_host] = engine.memory_report()
        numel = sum(p.numel() for p in engine.head_tail_params)
        engine.close()
    saved = reports[False].device_head_tail_bytes - reports[True].device_head_tail_bytes
    assert saved == numel * (layout.device_bytes_per_param(dtype) - 2 * dtype.itemsize)
    assert reports[True].device_head_tail_bytes == numel * 2 * dtype.itemsize
    assert reports[False].host_head_tail_bytes == 0
    assert reports[True].host_head_tail_bytes >= numel * layout.host_bytes_per_param(dtype)


# ---- failures, the rule, the flag


def test_an_inf_gradient_in_the_head_stops_the_run_with_nothing_updated():
    model = small_gpt()
    engine = ph.wrap(model, window=2, head_tail_on_host=True)
    before = {n: v.clone() for n, v in engine.states.master_parameters().items() if n.startswith("head")}
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    model.head.tok.weight.grad[0, 0] = float("inf")
    with pytest.raises(DivergenceError, match="head/tail gradient has inf/NaN"):
        engine.step()
    after = engine.states.master_parameters()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    engine.close()


def test_auto_puts_a_large_head_and_tail_on_the_host_of_a_cuda_device_only():
    """A Llama-3-8B head and tail (128,256 x 4,096 embedding and LM head, final norm) in bf16 would
    take 20 B per parameter on the device: over 1/8 of an 80 GiB GPU; a 38.6M-parameter GPT-2's
    would not; the CPU backend (no device memory) keeps them on its device."""
    numel = 2 * 128_256 * 4_096 + 4_096
    assert head_tail_on_host("auto", numel, 0, torch.bfloat16, 80 * 2**30)
    assert not head_tail_on_host("auto", 50_257 * 768 + 1_024 * 768, 0, torch.bfloat16, 80 * 2**30)
    assert not head_tail_on_host("auto", numel, 0, torch.bfloat16, None)
    assert head_tail_on_host(True, 1, 0, torch.float32, None) and not head_tail_on_host(False, numel, 0,
                                                                                          torch.bfloat16, 2**30)
    engine = ph.wrap(small_gpt(), window=2, head_tail_on_host="auto")  # the CPU backend: on its device
    assert not engine.head_tail_on_host and isinstance(engine.device_optimizer, DeviceAdamW)
    engine.close()


def test_head_tail_flag_sets_the_field_and_a_bad_value_is_one_line(capsys):
    from pystronghold.cli import build_parser
    from pystronghold.train.command import config_from_args
    from train_helpers import cli_error

    def runtime(*argv):
        return config_from_args(build_parser().parse_args(["train", *argv])).runtime

    assert runtime("--head-tail", "host").head_tail_on_host is True
    assert runtime("--head-tail", "device").head_tail_on_host is False
    assert runtime().head_tail_on_host == "auto"  # train's default: the planner decides (train/long_context.py)
    assert "--head-tail must be one of host, device, auto, got 'gpu'" in cli_error(capsys, ["train", "--head-tail",
                                                                                             "gpu"])
    with pytest.raises(ValueError, match=r"RuntimeConfig.head_tail_on_host must be True, False or 'auto'"):
        RuntimeConfig(head_tail_on_host="host")


# ---- checkpoints


@pytest.mark.parametrize("saved_on_host", [True, False])
def test_a_checkpoint_resumes_across_the_option_to_the_same_losses(tmp_path, monkeypatch, saved_on_host):
    """Saved with head and tail on one side, resumed on the other: steps 4..6 are the uninterrupted
    run's bit for bit (both Adams in torch's arithmetic: ``bitwise_torch``)."""
    import pystronghold.train.loop as loop
    from train_helpers import listing, run_training, tiny_config

    plain = loop.AdamW
    monkeypatch.setattr(loop, "AdamW", lambda **kw: plain(**kw, bitwise_torch=True))

    def config(on_host, **options):
        cfg = tiny_config(tmp_path, steps=6, precision="bf16", **options)
        cfg.runtime.head_tail_on_host = on_host
        return cfg

    straight = run_training(config(not saved_on_host))
    ck = tmp_path / "ck"
    run_training(config(saved_on_host, ckpt=str(ck), every=3))
    assert listing(ck) == ["step-00000003", "step-00000006"]
    shutil.rmtree(ck / "step-00000006")
    resumed = run_training(config(not saved_on_host, ckpt=str(ck), resume=True))
    assert resumed.start_step == 3
    assert resumed.losses == straight.losses[3:]


# ---- under torchrun


def test_tp_pp_and_dp_with_head_and_tail_on_the_host_log_the_single_process_losses(tmp_path):
    """A tied model (the pipeline's last stage holds a copy of the embedding, its gradient summed
    over the stages): TP, PP and DP runs with head and tail on the host log the losses of one
    process with them on the device, and a TP checkpoint written so resumes in one process on the
    device (its split head and tail gathered from the host)."""
    import json
    import os

    from torchrun_cli import assert_logs_reference, logged_losses, run_train
    from train_helpers import listing

    model = tmp_path / "tied.json"
    model.write_text(json.dumps(dict(vocab_size=256, seq_len=64, layers=4, hidden=64, heads=4, tie_embeddings=True)))
    tied = ("--model", str(model))
    p = run_train(1, *tied, "--head-tail", "device")
    assert p.returncode == 0, p.stderr
    reference = logged_losses(p.stdout)
    for layout in (("--pp", "2"), ("--dp", "2")):
        assert_logs_reference(run_train(2, *tied, *layout, "--head-tail", "host"), reference)
    ck = str(tmp_path / "ck")
    # NOTE: the --tp 2 launch that logs the losses is the one whose checkpoint is resumed (one launch fewer)
    p = run_train(2, *tied, "--tp", "2", "--head-tail", "host", "--checkpoint-dir", ck, "--checkpoint-every", "2")
    assert_logs_reference(p, reference)
    assert listing(ck) == ["step-00000002", "step-00000003"]
    shutil.rmtree(os.path.join(ck, "step-00000003"))
    assert_logs_reference(run_train(1, *tied, "--head-tail", "device", "--checkpoint-dir", ck, "--resume"),
                          reference, from_step=3)
