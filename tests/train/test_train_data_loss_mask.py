"""The loss of masked targets: -100 is ignored, a window of no target gives 0 (not NaN), and a step's
loss is the mean over every counted target of its micro-batches, as plain PyTorch computes it."""

from __future__ import annotations

import json

import torch

from pystronghold.data import IGNORE_INDEX, BatchSampler
from pystronghold.lr_schedule import warmup_cosine
from pystronghold.models.hf_loss import causal_lm_loss
from pystronghold.runtime.config import RuntimeConfig
from pystronghold.train import Trainer, resolve
from pystronghold.train.config import DataOptions, ModelOptions, OptimOptions, RunOptions, TrainConfig
from hf_models import VOCAB, save_tiny, set_chat_template


def test_causal_lm_loss_ignores_masked_targets_and_is_zero_without_any():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :3] = IGNORE_INDEX
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(causal_lm_loss(logits, targets), ref, rtol=1e-6, atol=0)
    none = causal_lm_loss(logits, torch.full((2, 5), IGNORE_INDEX))
    none.backward()
    assert none.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_steps_match_plain_pytorch_token_mean_over_micro_batches(tmp_path):
    """Chat data, 2 micro-batches a step (one of step 2 with every target masked): the Trainer's
    losses are those of transformers + torch.optim.AdamW where each step back-propagates
    sum(cross-entropy over the counted targets of both micro-batches) / their count."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path, "llama")
    set_chat_template(directory)
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for k in range(30):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"def f{k}(x):" + " x" * (k % 7)},
                                             {"role": "assistant", "content": f"    return x * {k} + 1"}]}) + "\n")
    steps, lr = 4, 3e-3
    config = TrainConfig(
        model=ModelOptions(model=f"hf:{directory}"),
        data=DataOptions(data=[str(data)], batch=2, seq=16),
        optim=OptimOptions(lr=lr, warmup=1, weight_decay=0.0),
        runtime=RuntimeConfig(window=2, clip_grad_norm=None, accumulation_steps=2),
        run=RunOptions(steps=steps, log_every=steps, eval_every=0, eval_batches=1, quiet=True))
    trainer = Trainer(resolve(config))
    drawn = []
    draw = trainer.sampler.next_batch

    def next_batch():  # the third micro-batch (step 2's first) has no target
        x, y = draw()
        if len(drawn) == 2:
            y = torch.full_like(y, IGNORE_INDEX)
        drawn.append((x, y))
        return x, y

    trainer.sampler.next_batch = next_batch
    try:
        got = [loss for _, loss in trainer.train().losses]
    finally:
        trainer.close()
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in drawn]
    assert counts[2] == 0 and counts[0] != counts[1]  # unequal counts: a mean of means would differ

    ref = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, config.optim.beta2), eps=1e-8, weight_decay=0.0)
    schedule = warmup_cosine(opt, warmup_steps=1, decay_steps=steps, min_ratio=config.optim.min_lr_ratio)
    expected = []
    for step in range(steps):
        micro = drawn[2 * step:2 * step + 2]
        count = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
        loss = sum(torch.nn.functional.cross_entropy(ref(input_ids=x).logits.flatten(0, 1), y.flatten(),
                                                     ignore_index=IGNORE_INDEX, reduction="sum")
                   for x, y in micro) / count
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        expected.append(loss.item())
    assert all(torch.isfinite(torch.tensor(got)))
    # NOTE: rtol 1e-5: the engine's fused Adam and its per-block reductions round differently from
    # torch's (test_models_hf_finetune holds them to 1e-6 per step; four steps here)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
