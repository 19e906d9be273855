"""Checkpoints with tensor parallelism: a TP=2 run (2 real gloo processes) saves, resumes, and
trades checkpoints with a single process, since the format holds whole parameters.

The TP=2 runs all happen in one launch of 2 ranks (``_tp2_runs``, several Trainers one after the
other in the same process group), the single-process runs in the test process. Tolerances: a TP=2
resume continues its own run exactly (same ranks, same sums: ``==``); TP=2 against one process
agrees to rounding (the TP partial sums are added in another order): rtol 1e-5 on losses and
logits, as test_parallel_runtime.py. Weights are compared through the logits: the key bias's true
gradient is exactly zero, so its AdamW update (eps 1e-8) is rounding noise scaled up to ~lr and
differs between the two runs, while it cannot change any output (softmax is shift-invariant).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from safetensors.torch import load_file

from pystronghold.models import GPT, GPTConfig
from pystronghold.train import Trainer, resolve
from pystronghold.train.checkpoint import CheckpointError, export_weights, read_manifest
from pystronghold.train.config import CheckpointOptions, ParallelOptions
from train_helpers import listing, save_trainer, tiny_config

STEP3, STEP6 = "step-00000003", "step-00000006"
TOL = dict(rtol=1e-5, atol=1e-6)


def _train(config, *, close_parallel: bool = True, before=None) -> list[tuple[int, float]]:
    """The (step, loss) list of one run; ``before(trainer)`` runs after a resume, before training."""
    trainer = Trainer(resolve(config))
    try:
        if before is not None:
            before(trainer)
        return trainer.train().losses
    finally:
        # NOTE: the ranks of _tp2_runs keep their process group for the next Trainer; _dist closes it
        trainer.close(keep_process_group=not close_parallel)


def _tp2_runs(rank: int, world: int, tmp: str, base) -> None:
    tmp = Path(tmp)

    def tp2(ckpt: Path, **options):
        return dataclasses.replace(base, parallel=ParallelOptions(tp=2, dist_timeout=30),
                                   checkpoint=CheckpointOptions(checkpoint_dir=str(ckpt), **options))

    out = {"straight": _train(tp2(tmp / "tp2", checkpoint_every=3), close_parallel=False)}
    if rank == 0:
        shutil.rmtree(tmp / "tp2" / STEP6)  # as if the run had been killed after step 3
    dist.barrier()
    # resume, after saving the loaded state again: gather(slice(whole)) must give back the files
    out["resumed"] = _train(tp2(tmp / "tp2", resume=True), close_parallel=False,
                            before=lambda trainer: save_trainer(trainer, tmp / "again"))
    out["from_single"] = _train(tp2(tmp / "single", resume=True), close_parallel=False)
    # a fresh run into tp2/, which holds checkpoints: rank 0 refuses, and rank 1 with it (no one waits)
    with pytest.raises(CheckpointError) as refused:
        Trainer(resolve(tp2(tmp / "tp2")))
    out["refused"] = str(refused.value)
    if rank == 0:
        (tmp / "tp2.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process run with checkpoints at 3 and 6, then the TP=2 runs; their losses by name."""
    tmp = tmp_path_factory.mktemp("tp")
    base = tiny_config(tmp, steps=6)
    single = tmp / "single"
    straight = _train(dataclasses.replace(base, checkpoint=CheckpointOptions(checkpoint_dir=str(single),
                                                                             checkpoint_every=3)))
    shutil.copytree(single / STEP6, tmp / "single-step6")  # kept aside for the export test
    shutil.rmtree(single / STEP6)
    run_ranks(_tp2_runs, 2, str(tmp), base, init=False, timeout_s=120)
    out = json.loads((tmp / "tp2.json").read_text())
    refused = out.pop("refused")
    return tmp, base, {"single": straight, "refused": refused, **{k: [tuple(x) for x in v] for k, v in out.items()}}


def _assert_losses_close(got, expected) -> None:
    assert [s for s, _ in got] == [s for s, _ in expected]
    torch.testing.assert_close(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in expected]), **TOL)


def test_tp2_resume_reproduces_the_uninterrupted_tp2_losses(runs):
    tmp, _, losses = runs
    assert [s for s, _ in losses["straight"]] == [1, 2, 3, 4, 5, 6]
    assert losses["resumed"] == losses["straight"][3:]  # steps 4..6, bit for bit
    _assert_losses_close(losses["straight"], losses["single"])  # TP=2 trains as one process does
    assert listing(tmp / "tp2") == [STEP3, STEP6]  # one writer: no clashes
    assert "already holds checkpoints (newest: step 6" in losses["refused"]


def test_tp2_checkpoint_holds_whole_parameters(runs):
    tmp, _, _ = runs
    tp2, single = read_manifest(tmp / "tp2" / STEP3), read_manifest(tmp / "single" / STEP3)
    assert tp2["written_by"] == {"tp": 2, "dp": 1, "pp": 1} and single["written_by"] == {"tp": 1, "dp": 1, "pp": 1}
    assert tp2["model"] == single["model"] and tp2["model"]["tp_size"] == 1
    assert tp2["files"].keys() == single["files"].keys()
    for rel in tp2["files"]:
        if rel.endswith(".safetensors"):
            a, b = load_file(str(tmp / "tp2" / STEP3 / rel)), load_file(str(tmp / "single" / STEP3 / rel))
            assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}, rel
    # loaded by TP=2 (each rank keeps its slice) and saved again: the same bytes
    again = read_manifest(tmp / "again" / STEP3)
    for rel, meta in tp2["files"].items():
        if rel.endswith(".safetensors"):
            assert again["files"][rel]["sha256"] == meta["sha256"], rel


def test_checkpoints_cross_between_tp2_and_one_process(runs, tmp_path):
    tmp, base, losses = runs
    # a single-process checkpoint resumed with TP=2 continues the single-process run
    _assert_losses_close(losses["from_single"], losses["single"][3:])
    # the TP=2 checkpoint resumed by one process continues the TP=2 run
    ck = tmp_path / "ck"
    shutil.copytree(tmp / "tp2" / STEP3, ck / STEP3)
    resumed = _train(dataclasses.replace(base, checkpoint=CheckpointOptions(checkpoint_dir=str(ck), resume=True)))
    _assert_losses_close(resumed, losses["resumed"])


def test_export_of_a_tp2_checkpoint_loads_into_a_plain_gpt(runs, tmp_path):
    tmp, _, _ = runs
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, path in [("tp2", tmp / "tp2" / STEP6), ("single", tmp / "single-step6")]:
        out = export_weights(path, tmp_path / f"{name}.safetensors")
        plain = GPT(GPTConfig(**read_manifest(path)["model"]), seed=123)  # weights must come from the file
        plain.load_state_dict(load_file(str(out)), strict=True)
        with torch.no_grad():
            logits[name] = plain(x)  # (B, T, V)
    torch.testing.assert_close(logits["tp2"], logits["single"], **TOL)
