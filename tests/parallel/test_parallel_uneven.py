"""Uneven DP batches (Whale's hardware-aware replicate) through the window runtime, 3 gloo ranks.

Rank r trains on b_r of the 8 sequences of each step ([4, 3, 1], from speeds 4:3:1) and scales its
mean loss by b_r * 3 / 8. Compared with plain PyTorch on the whole batch in one process: losses
(the DP-weighted mean) and gradient norms at rtol 1e-6 (fp32; the ranks sum the same products in
another order), parameters at the rtol/atol 1e-5 of test_parallel_runtime (AdamW divides by
sqrt(v), which turns rounding of a near-zero gradient into a parameter difference). Without the
weights the gradient is the mean of the three ranks' means: it misses by far more (checked).
A slowed rank (a compute delay) changes no number.
"""

from __future__ import annotations

import torch
from _dist import run_ranks
from parallel_training import single_process_run

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.parallel import init_parallel
from pystronghold.train.uneven import UnevenBatch, add_compute_delay

CFG = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=3, hidden=32, heads=4)
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
CLIP = 0.05
TOL = dict(rtol=1e-6, atol=1e-8)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)


def _data(steps: int = 3, batch: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, CFG.vocab_size, (steps, batch, CFG.seq_len + 1), generator=g)


def _train(data, split: UnevenBatch, groups, weighted: bool = True, delay_s: float = 0.0):
    model = GPT(CFG, seed=7)
    if delay_s:
        add_compute_delay(model, delay_s)
    engine = ph.wrap(model, blocks=model.blocks, window=2, parallel=groups, strict=True,
                     optimizer=ph.AdamW(**HYPER), clip_grad_norm=CLIP)
    losses, norms = [], []
    try:
        for tokens in data:
            mine = split.local(tokens)
            loss = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(split.scale(loss) if weighted else loss)
            losses.append(split.global_mean(loss, groups.dp_group))
            engine.step()
            engine.zero_grad()
            norms.append(engine.grad_norm)
        return losses, norms, engine.master_parameters()
    finally:
        engine.close()


def _uneven(rank: int, world: int) -> None:
    groups = init_parallel(tp_size=1, timeout_s=30)
    data = _data()
    ref_losses, ref_norms, ref_params = single_process_run(data.unsqueeze(1), CLIP, config=CFG)
    assert min(ref_norms) > CLIP  # clipping acts on every step: the norm is of the true gradient
    split = UnevenBatch.from_speeds(8, [4.0, 3.0, 1.0], dp_rank=groups.dp_rank)
    assert split.sizes == (4, 3, 1)
    for delay in (0.0, 0.002 if rank == 2 else 0.0):  # the slowed rank computes the same numbers
        losses, norms, params = _train(data, split, groups, delay_s=delay)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
        for name, p in ref_params.items():
            torch.testing.assert_close(params[name], p, **PARAM_TOL, msg=lambda m: f"{name}: {m}")
    # the unweighted mean of means is a different gradient: the test above can fail
    _, norms, _ = _train(data[:1], split, groups, weighted=False)
    assert abs(norms[0] - ref_norms[0]) > 1e-3 * ref_norms[0]


def test_uneven_dp_split_equals_one_process_on_the_global_batch():
    run_ranks(_uneven, 3, timeout_s=180)


def test_bad_splits_are_refused_and_a_rank_takes_its_rows():
    import pytest

    with pytest.raises(ValueError, match="dp_rank=3 is not in 0..2"):
        UnevenBatch(sizes=(1, 2, 3), dp_rank=3)
    with pytest.raises(ValueError, match="sizes must be positive ints"):
        UnevenBatch(sizes=(1, 0), dp_rank=0)
    with pytest.raises(ValueError, match=r"batch has 5 samples, the split \[1, 2\] needs 3"):
        UnevenBatch(sizes=(1, 2), dp_rank=0).local(torch.zeros(5, 2))
    assert UnevenBatch(sizes=(1, 2), dp_rank=1).local(torch.arange(3)).tolist() == [1, 2]
