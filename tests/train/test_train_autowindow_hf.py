"""`--window auto` and `--resident-blocks auto` for Hugging Face models: one of the model's own
blocks is measured, the planner costs the model from its config.json; `--seq` up to its positions."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from pystronghold.planner.cost import block_costs
from pystronghold.planner.plan import choose_split
from pystronghold.train import Trainer, resolve
from pystronghold.train.autowindow import HFProbe, measure_costs
from pystronghold.train.config import DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from pystronghold.runtime.config import RuntimeConfig
from train_helpers import cli_error

transformers = pytest.importorskip("transformers")

_BYTES = ("block_params", "block_numel", "slot_bytes", "head_tail_bytes", "block_input_bytes",
          "block_activation_bytes", "tail_activation_bytes", "resident_block_bytes")
"""The ``BlockCosts`` fields the planner gives (the measurement replaces only seconds)."""


def _inputs_seen(block) -> list:
    """Records (shape, dtype) of the hidden states of every forward of ``block`` (and of its copies)
    that ran to its end."""
    seen = []

    def record(_module, args, kwargs, _output):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append((tuple(x.shape), x.dtype))

    block.register_forward_hook(record, with_kwargs=True)
    return seen


def _hardware():
    from pystronghold.planner.hardware import GPU, Hardware

    return Hardware(gpu=GPU(name="x", memory_bytes=1 << 30, fp32_flops=1e12, bf16_flops=1e12, fp16_flops=1e12,
                            h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9), host_memory_bytes=1 << 34,
                    cpu_adam_params_per_s=1e9)


def _bytes(costs) -> dict:
    return {f: getattr(costs, f) for f in _BYTES}


def _train_config(directory, data, seq: int = 0, **runtime) -> TrainConfig:
    return TrainConfig(model=ModelOptions(model=f"hf:{directory}"),
                       data=DataOptions(data=[str(data)], max_bytes=16384, batch=2, seq=seq),
                       optim=OptimOptions(warmup=1), runtime=RuntimeConfig(**runtime),
                       run=RunOptions(steps=2, log_every=1, eval_every=0, eval_batches=1, quiet=True))


def test_auto_window_and_resident_blocks_for_an_hf_model(tmp_path, caplog):
    """llama from its directory: block 0 of the lazily loaded model (blocks on meta) runs at the run's
    (B, T); the bytes are the planner's for the model's config.json; the engine obeys the split."""
    from hf_models import TEXT, save_tiny

    from pystronghold.planner.hf_shape import read_hf_shape

    directory = save_tiny(tmp_path, "llama")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT * 4))
    config = _train_config(directory, data, window="auto", resident_blocks="auto")
    assert resolve(config).seq == 64  # the model's 64 positions: they fit
    with caplog.at_level(logging.INFO, logger="pystronghold.train"):
        trainer = Trainer(resolve(config))
    assert "seq: 64 tokens (the model's positions; fits " in caplog.text  # said at start-up, one line
    try:
        auto = trainer.auto_window
        assert auto.blocks == 3 and auto.work.seq == 64 and auto.work.batch == 2
        assert _bytes(auto.costs) == _bytes(block_costs(read_hf_shape(str(directory)), auto.work, _hardware()))
        assert auto.costs.block_params == sum(p.numel() for p in (
            transformers.AutoModelForCausalLM.from_pretrained(str(directory)).model.layers[0].parameters()))
        split = choose_split(auto.costs, auto.work, 3, auto.budget_bytes)
        assert (split.resident, split.window) == (auto.resident_blocks, auto.window)
        stats = trainer.engine.stats()
        assert (stats["resident_blocks"], trainer.engine.window_size) == (auto.resident_blocks, auto.window)
        assert auto.costs.fwd_s > 0 and auto.costs.bwd_s > 0 and auto.costs.load_s > 0
        trainer.train()
        assert trainer.step == 2
    finally:
        trainer.close()


@pytest.mark.parametrize("family", ["mixtral", "gpt2"])
def test_measured_block_is_the_hf_models_and_the_bytes_the_planners(family):
    """``measure_costs`` of an ``HFProbe`` runs a copy of the model's block 0 (a MoE block for
    mixtral; GPT-2's takes its hidden states by name) at (B, T) in the compute precision, and keeps
    the planner's bytes of the model's shape."""
    from hf_models import FAMILIES

    from pystronghold.planner.cost import Workload
    from pystronghold.planner.hf_shape import hf_shape_from_config

    config = transformers.AutoConfig.for_model(family, **FAMILIES[family])
    shape = hf_shape_from_config(config, source="tiny", architecture=family)
    model = transformers.AutoModelForCausalLM.from_config(config)
    blocks = model.get_submodule(shape.blocks_name)
    seen = _inputs_seen(blocks[0])
    work = Workload(batch=2, seq=16, precision="bf16")
    costs = measure_costs(HFProbe(shape=shape, model=model, blocks=blocks), work, torch.device("cpu"),
                          budget_bytes=1 << 30, reps=1)
    assert seen and set(seen) == {((2, 16, 32), torch.bfloat16)}  # only the copy ran, never the model's own
    assert _bytes(costs) == _bytes(block_costs(shape, work, _hardware()))
    assert costs.fwd_s > 0 and costs.bwd_s > 0 and costs.device_adam_s > 0


def test_seq_defaults_to_the_models_positions_when_they_fit(tmp_path, capsys):
    """A model of 1024 positions: 1024 by default (it fits this machine), said why; 1025 refused
    in one line."""
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                      num_attention_heads=4, vocab_size=97, max_position_embeddings=1024)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)  # config.json only: nothing else is read before the data
    data = tmp_path / "t.txt"
    data.write_text("x")
    train = resolve(_train_config(tmp_path, data))
    assert train.seq == 1024 and train.seq_why.startswith("the model's positions; fits")
    assert resolve(_train_config(tmp_path, data, seq=512)).seq == 512
    err = cli_error(capsys, ["train", "--model", f"hf:{tmp_path}", "--data", str(data), "--seq", "1025"])
    assert "--seq 1025 is longer than the model's 1024 positions" in err


def test_seq_default_is_capped_by_what_fits(tmp_path, monkeypatch):
    """Positions that do not fit the machine: the default is the longest context that does, through
    the planner (a 4 GiB device here), and says so."""
    from pystronghold.planner.hardware import GPU, GiB, Hardware
    from pystronghold.train import context

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, vocab_size=32000, max_position_embeddings=1 << 19)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    data = tmp_path / "t.txt"
    data.write_text("x")
    small = GPU(name="small", memory_bytes=4 * GiB, fp32_flops=1e12, bf16_flops=1e12, fp16_flops=1e12,
                h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10)
    monkeypatch.setattr(context, "this_machine", lambda: Hardware(gpu=small, host_memory_bytes=16 * GiB))
    run = resolve(_train_config(tmp_path, data))
    seq, why = run.seq, run.seq_why
    assert 0 < seq < 1 << 19 and "do not fit; the longest context that fits" in why


def test_a_model_without_positions_trains_at_512_by_default_and_longer_when_asked(tmp_path):
    """BLOOM (ALiBi) names no positions in its config.json: the default is 512, a longer --seq is
    taken, and plan costs the same 512 without --seq."""
    from hf_models import save_tiny

    from pystronghold.models.hf import read_hf_config
    from pystronghold.planner.command import PlanRequest

    directory = save_tiny(tmp_path, "bloom", tokenizer=False)
    assert not any(k in read_hf_config(directory).config for k in ("max_position_embeddings", "n_positions"))
    data = tmp_path / "t.txt"
    data.write_text("x")
    assert resolve(_train_config(directory, data)).seq == 512
    assert resolve(_train_config(directory, data, seq=4096)).seq == 4096
    request = PlanRequest(model=f"hf:{directory}", gpu="h100-80gb", host_memory=64)
    assert request.resolve()[1].seq == 512
