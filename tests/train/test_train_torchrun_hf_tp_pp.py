"""``torchrun -m pystronghold train --model hf:DIR --tp 2 --pp 2``: a Hugging Face model's pipeline
stages (``pipelining.hf``), each split over its own two TP ranks (``models.hf_tp``), launched as four
gloo processes, train to the one-process losses (every step's and the validation loss, read exactly
from --metrics-file): fp32 within 1e-5 relative.

Each model has 3 blocks: stage 0 holds the vocabulary-parallel embedding and block 0, stage 1 blocks
1-2, the final norm and the vocabulary-parallel LM head and loss.
"""

from __future__ import annotations

import pytest
import torch

from hf_models import save_tiny
from torchrun_cli import assert_losses_close, metrics_losses, run_hf

pytest.importorskip("transformers")

TP2_PP2 = ("--tp", "2", "--pp", "2", "--micro-batches", "2")
SPLIT = "pipeline split over 2 stages: stage 0: embedding + blocks 0-0; stage 1: blocks 1-2 + norm, LM head"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "gpt_neox"])
def test_tp2_pp2_trains_to_the_one_process_losses(tmp_path, family):
    """Llama (GQA, untied head), Qwen2 (q/k/v biases; a tied embedding: each TP rank sums its shard's
    gradient over the first and last stage), Gemma 2 (scaled embedding, soft-capped logits, sliding
    window layers), GPT-NeoX (fused query_key_value, biases)."""
    directory = save_tiny(tmp_path, family)
    _, one = run_hf(tmp_path, directory, "one", 1)
    p, split = run_hf(tmp_path, directory, "tp2-pp2", 4, *TP2_PP2)
    assert_losses_close(metrics_losses(split), metrics_losses(one))
    assert p.stdout.count(SPLIT) == 1
