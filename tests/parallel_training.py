"""Data and tensor parallelism through the window runtime, checked against one process: the GPT,
its data, the plain PyTorch reference on the whole batch and one rank's run through ``pystronghold.wrap``
(shared by tests/parallel/test_parallel_runtime.py and tests/runtime/test_runtime_resident.py; not a
test file).

Stated tolerance (fp32): rtol 1e-5 on losses, gradient norms and parameters, and atol 1e-5 on
parameters. The parallel runs sum the same products in another order (half batches, then the DP
average; TP partial sums), so they agree to rounding, not bit for bit; Adam divides by sqrt(v), so
an element whose gradient is near zero turns rounding into a parameter difference (seen: up to
3.6e-6, on 1 to 2 elements of a few thousand). One AdamW step moves a weight by ~lr = 3e-3, 300
times the tolerance, so a missing, doubled or unaveraged update still fails.
NOTE: AdamW eps=1e-6, not 1e-8, for the reason given in tests/parallel/test_parallel_gpt.py: the key bias's true
gradient is exactly zero, so it is pure rounding noise, which Adam would scale up to ~lr.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.parallel import gather_tp_param

CFG = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=4, hidden=32, heads=4)
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
TOL = dict(rtol=1e-5, atol=1e-7)  # losses and norms
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
CLIP = 0.05  # below every step's gradient norm (asserted), so clipping changes every update


def parallel_data(steps: int, micro: int, batch: int) -> torch.Tensor:
    """(steps, micro, batch, T + 1) token ids: inputs are [..., :-1], targets [..., 1:]."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (steps, micro, batch, CFG.seq_len + 1), generator=g)


def single_process_run(data: torch.Tensor, clip: float | None = None, config: GPTConfig = CFG):
    """Plain PyTorch on the whole batch: (losses per micro-batch, grad norms per step, params).
    ``data``: (steps, micro, batch, T + 1) token ids (``micro`` = 1: one backward per step);
    ``config``: the GPT's (seed 7, ``HYPER``)."""
    model = GPT(config, seed=7)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    losses, norms = [], []
    for step in data:
        for tokens in step:
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        opt.step()
        opt.zero_grad()
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def train_rank(model: GPT, data: torch.Tensor, groups, **options):
    """This rank's run through the window runtime on its slice of each micro-batch.

    Returns (DP-averaged losses per micro-batch, the engine's grad norm per step, fp32 masters).
    """
    engine = ph.wrap(model, blocks=model.blocks, window=2, parallel=groups, strict=True,
                     optimizer=ph.AdamW(**HYPER), accumulation_steps=data.shape[1], **options)
    per_rank = data.shape[2] // groups.dp_size
    mine = data[:, :, groups.dp_rank * per_rank:(groups.dp_rank + 1) * per_rank]
    losses, norms = [], []
    try:
        for step in mine:
            for tokens in step:
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                mean = loss.detach().clone().reshape(1)
                dist.all_reduce(mean, group=groups.dp_group)
                losses.append(mean.item() / groups.dp_size)
            engine.step()
            engine.zero_grad()
            norms.append(engine.grad_norm)
        params = engine.master_parameters()
    finally:
        engine.close()
    return losses, norms, params


def full_params(model: GPT, params: dict[str, torch.Tensor], tp_group) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's (possibly TP-split) fp32 masters (a collective over tp_group)."""
    out = {}
    for name, p in model.named_parameters():
        local = params[name].clone()
        local.tp_split = getattr(p, "tp_split", (0, 0, 1))
        out[name] = gather_tp_param(local, tp_group)
    return out


def assert_matches_single_process(got, ref, *, clipped: bool) -> None:
    (losses, norms, params), (ref_losses, ref_norms, ref_params) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    if clipped:
        assert min(ref_norms) > CLIP, ref_norms  # clipping really changed every step
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    assert params.keys() == ref_params.keys()
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, **PARAM_TOL, msg=lambda m: f"{name}: {m}")


def assert_replicas_identical(params: dict[str, torch.Tensor], dp_group) -> None:
    """Bit-identical parameters on every DP rank."""
    flat = torch.cat([p.reshape(-1) for _, p in sorted(params.items())])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(copies, flat, group=dp_group)
    for other in copies[1:]:
        assert torch.equal(other, copies[0])
