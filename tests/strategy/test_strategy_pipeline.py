"""Whale's ``stage()`` / ``pipeline()`` scopes run on the pipeline runtime, on real gloo processes.

A GPT whose blocks are annotated into two stages (block 0, then blocks 1-3) inside
``pipeline(num_micro_batch=2)`` (and ``replicate(2)``: two replicas of the pipeline) is laid out by ``layout_of``, its groups made by ``init_layout``
and its stages built by ``gpt_pipeline_of``: each stage must run the blocks its scope names (not the
runtime's balanced split) and train to the losses of the same GPT through the unannotated
pipeline, and of plain PyTorch on the whole batch. Tolerance rtol 1e-6 (fp32; the pipelines sum the
same products in another grouping only: test_parallel_pipeline's tolerance). One AdamW step moves
the loss by ~1e-2, so a stage that does not train, or a micro-batch scale off, fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.pipelining import gpt_pipeline_of
from pystronghold.strategy import annotate, init_layout, layout_of

CFG = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=4, hidden=32, heads=4,
                tie_embeddings=True)
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
TOL = dict(rtol=1e-6, atol=1e-7)
MICRO = 2
STEPS = 3


def _data(dp: int) -> torch.Tensor:
    """(steps, batch, T + 1) token ids: inputs are [..., :-1], targets [..., 1:]."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (STEPS, 2 * MICRO * dp, CFG.seq_len + 1), generator=g)


def _reference(data: torch.Tensor) -> list[float]:
    model = GPT(CFG, seed=7)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    losses = []
    for tokens in data:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _annotated_gpt(dp: int) -> GPT:
    model = GPT(CFG, seed=7)
    with ph.replicate(dp), ph.pipeline(MICRO):
        with ph.stage():
            annotate(model.blocks[0])  # the embeddings join this first stage, unannotated
        with ph.stage():
            annotate(*model.blocks[1:])  # the final norm and LM head join the last stage
    return model


def _train(pipe, groups, data: torch.Tensor) -> tuple[list[float], list[range]]:
    """This replica's slice of every batch through ``pipe``: (global mean losses, stage ranges)."""
    per = data.shape[1] // groups.dp_size
    losses = []
    try:
        for tokens in data[:, groups.dp_rank * per:(groups.dp_rank + 1) * per]:
            loss = torch.tensor([pipe.step(tokens[:, :-1], tokens[:, 1:])], dtype=torch.float64)
            if groups.dp_size > 1:
                dist.all_reduce(loss, group=groups.dp_group)
            losses.append(float(loss) / groups.dp_size)
        return losses, pipe.stage_blocks
    finally:
        pipe.close()


def _scoped_and_plain(rank: int, world: int, dp: int) -> None:
    from pystronghold.pipelining import gpt_pipeline

    data = _data(dp)
    model = _annotated_gpt(dp)
    layout = layout_of(model, world_size=world)
    assert layout.pp_size == 2 and layout.num_micro_batch == MICRO and layout.dp_size == dp
    groups = init_layout(layout, heads=CFG.heads, timeout_s=30)
    assert (groups.pp_size, groups.dp_size) == (2, dp)
    assert rank in layout.stage_ranks(groups.dp_rank, groups.pp_rank)  # the scopes' rank order is the runtime's
    scoped, spans = _train(gpt_pipeline_of(model, layout, groups, window=1, optimizer=ph.AdamW(**HYPER)),
                           groups, data)
    assert spans == [[0], [1, 2, 3]]  # the scopes' stages, not a balanced split
    plain, plain_spans = _train(gpt_pipeline(GPT(CFG, seed=7), groups, micro_batches=MICRO, window=1,
                                             optimizer=ph.AdamW(**HYPER)), groups, data)
    assert plain_spans != spans  # the runtime's own split is another one: the scopes chose theirs
    torch.testing.assert_close(torch.tensor(scoped), torch.tensor(plain), **TOL)
    torch.testing.assert_close(torch.tensor(scoped), torch.tensor(_reference(data)), **TOL)
    assert scoped[-1] < scoped[0]


@pytest.mark.parametrize("dp", [1, 2], ids=["pp2", "pp2-dp2"])
def test_stage_scopes_train_through_the_pipeline_to_the_unannotated_losses(dp):
    run_ranks(_scoped_and_plain, 2 * dp, dp, timeout_s=150)


def test_init_layout_refuses_stages_of_unlike_tp_degrees():
    with ph.stage():
        a = nn.Linear(2, 2)
    with ph.stage(), ph.split(2):
        b = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"split degrees \[1, 2\]; the pipeline runtime runs one TP degree"):
        init_layout(layout_of(nn.Sequential(a, b), world_size=3))


def test_gpt_pipeline_of_refuses_a_layout_without_stages():
    from pystronghold.parallel import init_parallel

    model = GPT(CFG, seed=7)
    with pytest.raises(ValueError, match="the layout has one stage"):
        gpt_pipeline_of(model, layout_of(model, world_size=1), init_parallel())
