"""`pystronghold train --model hf:DIR` with LoRA (``--lora-rank``) or partial fine-tuning
(``--freeze``), end to end through the CLI on a tiny Llama saved in the test's tmp directory: the
checkpoint holds only what trains, a resumed run gives the uninterrupted losses bit for bit, and
`export --hf` (adapters in PEFT's format, or ``--merge``d, or a --freeze run's whole model) reloads
in transformers/peft to the trained engine's logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pystronghold.cli import build_parser, main
from pystronghold.train import Trainer, resolve
from pystronghold.train.command import config_from_args
from hf_models import TEXT, VOCAB, engine_logits, hf_logits, save_tiny
from train_helpers import cli_error

LORA = ["--lora-rank", "4", "--lora-targets", "q_proj,v_proj,down_proj", "--lora-dropout", "0.1"]
FREEZE = ["--freeze", r"embed|layers\.[01]\."]
"""The tiny Llama's embedding and first two of its three layers frozen: layer 2, the final norm and
the (untied) lm_head train."""


def train_args(directory, data, ck, finetune, *, steps=6, every=0, resume=False, metrics=None) -> list[str]:
    return (["train", "--model", f"hf:{directory}", *finetune, "--data", str(data), "--steps", str(steps),
             "--batch", "2", "--seq", "16", "--max-bytes", "16384", "--lr", "1e-2", "--warmup", "2",
             "--window", "2", "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--quiet",
             "--checkpoint-dir", str(ck), "--checkpoint-every", str(every)]
            + (["--resume"] if resume else []) + (["--metrics-file", str(metrics)] if metrics else []))


def losses(metrics) -> list[float]:
    return [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def trained_logits(args: list[str], x: torch.Tensor) -> torch.Tensor:
    """Logits of the engine restored (--resume) from the last checkpoint of ``args``' run."""
    trainer = Trainer(resolve(config_from_args(build_parser().parse_args(args + ["--resume"]))))
    try:
        return engine_logits(trainer.engine, x)
    finally:
        trainer.close()


@pytest.fixture
def llama(tmp_path):
    directory = save_tiny(tmp_path, "llama")
    data = tmp_path / "text.txt"
    data.write_text("".join(TEXT * 6))
    return directory, data


def tokens(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 16), generator=g)


@pytest.mark.parametrize("kind", ["lora", "freeze"])
def test_resumed_run_gives_the_uninterrupted_losses_and_saves_only_what_trains(tmp_path, llama, kind, request):
    """6 steps in one run, and 3 + 3 in two (the second resumes the step-3 checkpoint): the same
    losses, bit for bit (fp32; LoRA dropout draws restored with the RNG). The checkpoint's files hold
    the trainable parameters and their moments only; the manifest records the options and the
    base directory's fingerprint."""
    directory, data = llama
    if kind == "lora":
        request.getfixturevalue("peft")
    finetune = LORA if kind == "lora" else FREEZE
    assert main(train_args(directory, data, tmp_path / "a", finetune, metrics=tmp_path / "a.jsonl")) == 0
    whole = losses(tmp_path / "a.jsonl")
    assert len(whole) == 6 and whole[0] != whole[-1]
    assert main(train_args(directory, data, tmp_path / "b", finetune, every=3)) == 0
    shutil.rmtree(tmp_path / "b" / "step-00000006")  # as if killed after step 3
    assert main(train_args(directory, data, tmp_path / "b", finetune, resume=True, metrics=tmp_path / "b.jsonl")) == 0
    assert losses(tmp_path / "b.jsonl") == whole[3:]

    from safetensors.torch import load_file

    ck = tmp_path / "a" / "step-00000006"
    names = set()
    for file in [*sorted((ck / "blocks").iterdir()), ck / "head_tail.safetensors"]:
        names |= set(load_file(str(file)))
    params = {n for n in names if not n.endswith((".exp_avg", ".exp_avg_sq", ".step"))}
    if kind == "lora":  # 3 layers x 3 targets x (A, B)
        assert len(params) == 18 and all(".lora_A.default." in n or ".lora_B.default." in n for n in params)
    else:
        assert params and all(n.startswith(("model.layers.2.", "model.norm.", "lm_head.")) for n in params)
        assert "lm_head.weight" in params and "model.layers.2.mlp.up_proj.weight" in params
    assert {n + ".exp_avg" for n in params} <= names
    manifest = json.loads((ck / "manifest.json").read_text())
    if kind == "lora":
        assert manifest["finetune"] == {"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1,
                                                 "targets": ["down_proj", "q_proj", "v_proj"]}, "freeze": None}
    else:
        assert manifest["finetune"] == {"lora": None, "freeze": FREEZE[1]}
    assert manifest["base"]["source"] == str(directory.resolve())
    assert "config.json" in manifest["base"]["fingerprint"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_export_adapters_and_merged_model_reload_to_the_trained_logits(peft, tmp_path, llama, arch):
    """`export --hf`: adapter_config.json + adapter_model.safetensors that
    PeftModel.from_pretrained(base, DIR) loads to the engine's logits exactly; `export --hf --merge`:
    a model directory transformers loads, whose logits are the engine's up to the rounding of
    W + (alpha/r) B A against x W + (alpha/r) (x A) B, and peft's own merge_and_unload's. GPT-2:
    Conv1D layers (weights stored transposed), a tied lm_head, dropout."""
    from transformers import AutoModelForCausalLM

    directory, data = llama
    lora, targets = LORA, ["down_proj", "q_proj", "v_proj"]
    if arch == "gpt2":
        directory = save_tiny(tmp_path, "gpt2")
        lora, targets = ["--lora-rank", "4", "--lora-targets", "c_attn,mlp.c_proj"], ["c_attn", "mlp.c_proj"]
    args = train_args(directory, data, tmp_path / "ck", lora)
    assert main(args) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "adapter"), "--hf"]) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "merged"), "--hf", "--merge",
                 "--max-shard-size", "30kB"]) == 0
    x = tokens()
    trained = trained_logits(args, x)
    assert not torch.equal(trained, hf_logits(directory, x))  # the adapters changed the model

    adapter = tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapter.iterdir()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, targets)
    base = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
    reloaded = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=x).logits, trained, rtol=0, atol=0)
        peft_merged = reloaded.merge_and_unload()(input_ids=x).logits

    assert len(list((tmp_path / "merged").glob("model-*.safetensors"))) > 1
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = hf_logits(tmp_path / "merged", x)
    torch.testing.assert_close(merged, peft_merged, rtol=0, atol=1e-5)  # the same sum, other order
    torch.testing.assert_close(merged, trained, rtol=0, atol=1e-5)


def test_freeze_export_is_the_whole_model(tmp_path, llama):
    """A --freeze run's `export --hf`: the trained parameters from the checkpoint, the frozen ones
    from the base directory; transformers loads it to the engine's logits exactly."""
    directory, data = llama
    args = train_args(directory, data, tmp_path / "ck", FREEZE, steps=3)
    assert main(args) == 0
    assert main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--hf"]) == 0
    x = tokens()
    torch.testing.assert_close(hf_logits(tmp_path / "out", x), trained_logits(args, x), rtol=0, atol=0)


def test_a_changed_base_other_options_and_bad_options_are_one_line(peft, tmp_path, llama, capsys):
    directory, data = llama
    args = train_args(directory, data, tmp_path / "ck", LORA, steps=2)
    assert main(args) == 0
    other_rank = train_args(directory, data, tmp_path / "ck", ["--lora-rank", "2"], steps=3, resume=True)
    assert "was trained with --lora-rank 4 --lora-alpha 8 --lora-targets down_proj,q_proj,v_proj " \
           "--lora-dropout 0.1, this run with --lora-rank 2" in cli_error(capsys, other_rank)
    assert "neither --lora-rank nor --freeze" in cli_error(
        capsys, train_args(directory, data, tmp_path / "ck", [], steps=3, resume=True))
    # the base re-saved in other shards: its fingerprint changes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    for shard in directory.glob("model*.safetensors*"):
        shard.unlink()
    model.save_pretrained(str(directory), max_shard_size="50KB")
    err = cli_error(capsys, train_args(directory, data, tmp_path / "ck", LORA, steps=3, resume=True))
    assert f"holds only the trained parameters; the frozen ones come from {directory.resolve()}, which has " \
           "changed since" in err and "resume with the base it was trained from" in err
    assert "export with the base" in cli_error(capsys, ["export", str(tmp_path / "ck"), str(tmp_path / "o"), "--hf"])
    assert not (tmp_path / "o").exists()

    for argv, message in [
        (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
        (["--model", f"hf:{directory}", "--lora-rank", "4", "--freeze", "embed"], "--freeze and --lora-rank"),
        (["--model", f"hf:{directory}", "--lora-rank", "4", "--lora-targets", "nothing_here"], "--lora-targets"),
        (["--freeze", "("], "is not a regular expression"),
        (["--model", f"hf:{directory}", "--freeze", "no_such_name"], "matches no parameter"),
        (["--model", f"hf:{directory}", "--freeze", "."], "matches every parameter"),
    ]:
        assert message in cli_error(capsys, ["train", *argv, "--data", str(data), "--steps", "1", "--quiet"]), argv


def test_merge_of_a_checkpoint_without_adapters_is_refused(tmp_path, llama, capsys):
    directory, data = llama
    assert main(train_args(directory, data, tmp_path / "ck", FREEZE, steps=1)) == 0
    assert "holds no LoRA adapters" in cli_error(
        capsys, ["export", str(tmp_path / "ck"), str(tmp_path / "m"), "--hf", "--merge"])
    assert "--merge need --hf" in cli_error(capsys, ["export", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"),
                                                      "--merge"])


def test_lora_without_peft_is_one_line_before_training(tmp_path, llama, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # find_spec now answers "not installed"
    err = cli_error(capsys, train_args(*llama, tmp_path / "ck", ["--lora-rank", "4"]))
    assert "--lora-rank needs peft" in err and "pip install 'pystronghold[peft]'" in err


def test_a_lora_run_prints_no_future_warning_and_names_its_lr(peft, tmp_path, llama):
    """A LoRA run in a fresh interpreter (Python's default warning filters, as a user's): PEFT's call of
    the deprecated ``is_gradient_checkpointing`` does not reach stderr; the start-up line gives the
    LoRA learning rate chosen without --lr."""
    import os
    import subprocess
    import sys

    directory, data = llama
    args = [a for a in train_args(directory, data, tmp_path / "ck", ["--lora-rank", "4"], steps=1)
            if a not in ("--lr", "1e-2")]
    run = subprocess.run([sys.executable, "-m", "pystronghold", *args], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Warning" not in run.stderr, run.stderr
    assert "AdamW: peak lr 0.0002 (LoRA's default)" in run.stdout


def test_a_base_edited_in_place_at_the_same_size_is_refused(peft, tmp_path, llama, capsys):
    """The base's weights scaled x10 and saved over the shard at the same size (and then with the
    shard's mtime set back): resume and export refuse in one line naming the shard. Resuming from the
    unchanged base in a new process hashes nothing: the manifest's crc32c is trusted under the
    file's unchanged size, mtime, ctime and inode."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    directory, data = llama
    args = train_args(directory, data, tmp_path / "ck", LORA, steps=2, every=2)
    assert main(args) == 0
    manifest = json.loads((tmp_path / "ck" / "step-00000002" / "manifest.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    assert set(manifest["base"]["fingerprint"][shard.name]) == {"bytes", "crc32c", "stat"}

    resume = train_args(directory, data, tmp_path / "ck", LORA, steps=3, every=3, resume=True)
    run = subprocess.run([sys.executable, "-m", "pystronghold", *resume], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert run.returncode == 0, run.stderr
    assert "hashed" not in run.stdout  # the manifest's crc32c, trusted: no weights read twice

    before = shard.stat()
    tensors = load_file(str(shard))
    save_file({k: t * 10 for k, t in tensors.items()}, str(shard), metadata={"format": "pt"})
    assert shard.stat().st_size == before.st_size
    again = train_args(directory, data, tmp_path / "ck", LORA, steps=4, resume=True)
    for set_mtime_back in (False, True):
        if set_mtime_back:  # ctime cannot be set back: the file is hashed again
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert shard.stat().st_mtime_ns == before.st_mtime_ns
        err = cli_error(capsys, again)
        assert f"which has changed since ({shard.name} differ); resume with the base it was trained from" in err
        assert f"({shard.name} differ); export with the base" in cli_error(
            capsys, ["export", str(tmp_path / "ck"), str(tmp_path / "o"), "--hf"])
