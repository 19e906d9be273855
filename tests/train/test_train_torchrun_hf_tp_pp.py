"""``torchrun -m pystronghold train --model hf:DIR --tp 2 --pp 2``: a Hugging Face model's pipeline
stages (``pipelining.hf``), each split over its own two TP ranks (``models.hf_tp``), launched as four
gloo processes, train to the one-process losses (every step's and the validation loss, read exactly
from --metrics-file): fp32 within 1e-5 relative, bf16 within 1e-4 (as ``test_train_hf_tp.py``'s bf16
test).

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
    gradient over the first and last stage), Gemma 2 (scaled tied embedding, soft-capped
    logits), GPT-NeoX (fused query_key_value, biases)."""
    directory = save_tiny(tmp_path, family)
    _, one = run_hf(tmp_path, directory, "one", 1)
    p, split = run_hf(tmp_path, directory, "tp2-pp2", 4, *TP2_PP2)
    assert_losses_close(metrics_losses(split), metrics_losses(one))
    assert p.stdout.count(SPLIT) == 1


def test_pp2_and_tp2_pp2_in_bf16_train_to_the_one_process_losses(tmp_path):
    """bf16 compute (fp32 masters). NOTE: rtol 1e-4, not 1e-5: a micro-batch's loss and gradients,
    and each TP partial sum before its all-reduce, are rounded to bf16 (unit roundoff 2^-8) where one
    process rounds the whole; measured apart by up to 1.2e-5 (PP2) and 6.9e-5 (TP2 x PP2)."""
    directory = save_tiny(tmp_path, "llama")
    bf16 = ("--precision", "bf16")
    _, one = run_hf(tmp_path, directory, "one", 1, *bf16)
    _, pp = run_hf(tmp_path, directory, "pp2", 2, "--pp", "2", "--micro-batches", "2", *bf16)
    _, split = run_hf(tmp_path, directory, "tp2-pp2", 4, *TP2_PP2, *bf16)
    assert_losses_close(metrics_losses(pp), metrics_losses(one), rtol=1e-4)
    assert_losses_close(metrics_losses(split), metrics_losses(one), rtol=1e-4)
