"""`pystronghold train --freeze REGEX` on pystronghold's GPT: the matched parameters keep their
initial values (the checkpoint holds them: a GPT has no base directory to leave them to), the
others train, and --window auto plans the run."""

from __future__ import annotations

import dataclasses

import torch

from pystronghold.models import GPT, GPTConfig
from pystronghold.settings.finetune import FinetuneOptions
from pystronghold.train.checkpoint import export_weights
from pystronghold.train.checkpoint_dir import latest_checkpoint
from train_helpers import TINY, run_training, tiny_config

FROZEN = r"^head\.|blocks\.[01]\."


def test_freeze_with_window_auto_trains_only_the_rest(tmp_path):
    import re

    config = dataclasses.replace(tiny_config(tmp_path, steps=3, window="auto", ckpt=str(tmp_path / "ck")),
                                 finetune=FinetuneOptions(freeze=FROZEN))
    trainer = run_training(config, keep=True)
    assert trainer.auto_window is not None
    weights = export_weights(latest_checkpoint(tmp_path / "ck"), tmp_path / "w.pt")
    final = torch.load(weights)["state_dict"]
    initial = dict(GPT(GPTConfig(**TINY), seed=0).named_parameters())
    frozen = [n for n in initial if re.search(FROZEN, n)]
    assert frozen and len(frozen) < len(initial)
    for name, p in initial.items():
        assert torch.equal(final[name], p.detach()) == (name in frozen), name
