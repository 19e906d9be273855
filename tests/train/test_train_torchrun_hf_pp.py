"""``torchrun -m pystronghold train --model hf:DIR --pp 2``: a Hugging Face model's pipeline stages
(``pipelining.hf``) launched as two gloo processes train to the one-process losses (fp32, every
step's and the validation loss within 1e-5 relative, read exactly from --metrics-file), for Llama
(3 blocks: an uneven 1 + 2 split), Qwen2 and Gemma 2 (tied embeddings: the gradient is summed over
the first and last stage; Gemma 2's soft-capped logits and sliding-window layers), GPT-NeoX, a
mixture of experts (Qwen2-MoE), GPT-2, BLOOM and OPT (parts beside the blocks on the first and last
stage), the chunked loss, LoRA, --freeze (a frozen tied embedding: no gradient to sum), and the
interleaved schedule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hf_models import NO_DROPOUT, save_tiny
from torchrun_cli import HF_TIMEOUT_S, assert_losses_close, metrics_losses, run_hf

PARTS = {"gpt2": ("embedding, position table", "norm, LM head"),
         "bloom": ("embedding, embedding norm", "norm, LM head"),
         "opt": ("embedding, position table, input projection", "norm, output projection, LM head")}
"""The parts the first and the last stage hold beside the blocks (the split's log line), where not
the embedding and the norm and LM head."""


@pytest.mark.parametrize("family,extra", [
    ("llama", ()), ("qwen2", ()), ("gemma2", ()), ("gpt_neox", ()), ("qwen2_moe", ()), ("gpt2", ()), ("bloom", ()),
    ("opt", ()), ("llama", ("--loss-chunk", "7")), ("llama", ("--lora-rank", "4")),
    ("qwen2", ("--freeze", r"embed|layers\.[02]\.self_attn")),
], ids=["llama", "qwen2-tied", "gemma2", "gpt_neox", "qwen2_moe", "gpt2-tied", "bloom", "opt-projected",
        "llama-chunked-loss", "llama-lora", "qwen2-frozen-tied-embedding"])
def test_pp2_trains_to_the_one_process_losses(tmp_path, family, extra):
    """GPT-2's position table, BLOOM's embedding norm (and its ALiBi biases, made on every stage) and
    OPT's position table and input projection train on the first stage; OPT's final norm and output
    projection (its embedding 16 wide, its blocks 32) on the last; GPT-2's, BLOOM's and OPT's tied
    LM heads sum their gradients with the embedding's."""
    overrides = dict(NO_DROPOUT.get(family, {}), **({"word_embed_proj_dim": 16} if family == "opt" else {}))
    directory = save_tiny(tmp_path, family, **overrides)
    _, one = run_hf(tmp_path, directory, "one", 1, *extra)
    p, pp = run_hf(tmp_path, directory, "pp2", 2, "--pp", "2", "--micro-batches", "2", *extra)
    assert_losses_close(metrics_losses(pp), metrics_losses(one))
    first, last = PARTS.get(family, ("embedding", "norm, LM head"))
    assert p.stdout.count(f"pipeline split over 2 stages: stage 0: {first} + blocks 0-0; "
                          f"stage 1: blocks 1-2 + {last}") == 1


def test_pp2_interleaved_trains_to_the_one_process_losses(tmp_path):
    """Two model chunks per rank over 4 blocks: rank 0 holds blocks 0 and 2, rank 1 blocks 1 and 3."""
    directory = save_tiny(tmp_path, "llama", num_hidden_layers=4)
    _, one = run_hf(tmp_path, directory, "one", 1)
    p, pp = run_hf(tmp_path, directory, "pp2", 2, "--pp", "2", "--micro-batches", "2", "--pp-schedule",
                   "interleaved", "--pp-chunks", "2")
    assert_losses_close(metrics_losses(pp), metrics_losses(one))
    assert "rank 0 chunk 1: blocks 2-2" in p.stdout and "rank 1 chunk 1: blocks 3-3 + norm, LM head" in p.stdout


def test_hf_pp_layouts_are_checked_before_any_collective(tmp_path, monkeypatch):
    """The model's block count comes from its config.json: more stages than blocks is one line."""
    from pystronghold.options import ConfigError
    from pystronghold.train import resolve
    from pystronghold.train.config import DataOptions, ModelOptions, ParallelOptions, TrainConfig

    directory = save_tiny(tmp_path, "llama", tokenizer=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="ParallelOptions.pp=4 stages are more than the model's 3 blocks"):
        resolve(TrainConfig(model=ModelOptions(model=f"hf:{directory}"), data=DataOptions(data=[str(tmp_path)], batch=4),
                            parallel=ParallelOptions(pp=4)))


def _export(tmp_path, checkpoint, name: str) -> dict:
    """``pystronghold export CHECKPOINT --hf`` of step 3; the exported weights (transformers loads them)."""
    import torch
    import transformers

    out = tmp_path / name
    p = subprocess.run([sys.executable, "-m", "pystronghold", "export", str(checkpoint / "step-00000003"), str(out),
                        "--hf"], capture_output=True, text=True, timeout=HF_TIMEOUT_S,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_pp2_checkpoint_resumes_in_one_process_and_exports_the_hub_layout(tmp_path):
    """The PP2 checkpoint names every tensor as one process does (blocks under ``transformer.h``, the
    tied embedding once, the position table of the first stage and the final norm of the last under
    theirs), so one process resumes it to the losses of resuming its own checkpoint, and its Hub
    export equals the one-process run's (GPT-2: tied embeddings; Qwen2's PP2 checkpoint resumes and
    exports in test_train_torchrun_hf_tp_pp.py)."""
    import torch

    directory = save_tiny(tmp_path, "gpt2", **NO_DROPOUT["gpt2"])
    one_dir, pp_dir = tmp_path / "ck-one", tmp_path / "ck-pp2"
    run_hf(tmp_path, directory, "one", 1, "--checkpoint-dir", str(one_dir))
    run_hf(tmp_path, directory, "pp2", 2, "--pp", "2", "--micro-batches", "2", "--checkpoint-dir", str(pp_dir))
    one_export, pp_export = _export(tmp_path, one_dir, "hub-one"), _export(tmp_path, pp_dir, "hub-pp2")
    assert one_export.keys() == pp_export.keys()
    for key, value in one_export.items():
        torch.testing.assert_close(pp_export[key], value, rtol=1e-5, atol=1e-6, msg=key)
    resume = ("--steps", "5", "--resume")
    _, from_one = run_hf(tmp_path, directory, "resumed-one", 1, "--checkpoint-dir", str(one_dir), *resume)
    _, from_pp = run_hf(tmp_path, directory, "resumed-pp2", 1, "--checkpoint-dir", str(pp_dir), *resume)
    want = metrics_losses(from_one)
    got = metrics_losses(from_pp)
    assert len(got) == len(want) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


def test_pp2_lora_checkpoint_exports_the_one_process_adapters(tmp_path):
    """A --lora-rank run's PP2 checkpoint names its adapters under PEFT's names, as one process does:
    its PEFT export equals the one-process run's."""
    import torch
    from safetensors.torch import load_file

    directory = save_tiny(tmp_path, "llama")
    adapters = {}
    for name, nproc, extra in (("one", 1, ()), ("pp2", 2, ("--pp", "2", "--micro-batches", "2"))):
        checkpoint, out = tmp_path / f"ck-{name}", tmp_path / f"adapter-{name}"
        run_hf(tmp_path, directory, name, nproc, "--lora-rank", "4", "--checkpoint-dir", str(checkpoint), *extra)
        p = subprocess.run([sys.executable, "-m", "pystronghold", "export", str(checkpoint), str(out), "--hf"],
                           capture_output=True, text=True, timeout=HF_TIMEOUT_S,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stderr[-3000:]
        adapters[name] = load_file(str(out / "adapter_model.safetensors"))
    assert adapters["one"].keys() == adapters["pp2"].keys()
    assert len(adapters["one"]) == 3 * 2 * 2  # blocks x (q, v) x (A, B)
    for key, value in adapters["one"].items():
        torch.testing.assert_close(adapters["pp2"][key], value, rtol=1e-5, atol=1e-6, msg=key)
