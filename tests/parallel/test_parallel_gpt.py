import dataclasses

import pytest
import torch
from _dist import run_ranks

from pystronghold.models import GPT, GPTConfig, block_param_count
from pystronghold.parallel import gather_tp_param, init_parallel

# fp32: the TP run sums partial products in another order, so allow rounding (the 1e-5)
TOL = dict(rtol=1e-5, atol=1e-5)

CONFIGS = {
    "untied": GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=2, hidden=32,
                        heads=4, tp_size=2),
    "tied-nobias": GPTConfig(vocab_size=100, vocab_pad_multiple=4, seq_len=16, layers=3,
                             hidden=48, heads=2, mlp_ratio=2, tie_embeddings=True, bias=False,
                             tp_size=2),
}


def test_tp_config_needs_a_group_of_that_size():
    with pytest.raises(ValueError, match="tp_size=2 but the tensor-parallel group has 1 ranks"):
        GPT(CONFIGS["untied"])


def _gathered(model: GPT, group, grads: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        tensor = p.grad if grads else p
        if grads:
            tensor.tp_split = getattr(p, "tp_split", (0, 0, 1))
        out[name] = gather_tp_param(tensor, group)
    return out


def _equal_to_single_process(rank: int, world: int) -> None:
    g = init_parallel(tp_size=2, heads=4).tp_group
    for name, cfg in CONFIGS.items():
        ref = GPT(dataclasses.replace(cfg, tp_size=1), seed=7)
        par = GPT(cfg, seed=7, tp_group=g)
        assert par.blocks[0].attn.n_head == cfg.heads // 2
        local = sum(p.numel() for p in par.blocks[0].parameters())
        assert local == block_param_count(cfg, per_tp_rank=True) < block_param_count(cfg)
        # the same initial weights, exactly
        ref_params = dict(ref.named_parameters())
        for pname, full in _gathered(par, g).items():
            torch.testing.assert_close(full, ref_params[pname], rtol=0, atol=0, msg=f"{name} {pname}")
        # built with meta blocks and materialized one by one: this rank's slices, bit for bit
        lazy = GPT(cfg, seed=7, tp_group=g, materialize_blocks=False)
        for i in range(cfg.layers):
            lazy.materialize_block_(i)
        par_params = dict(par.named_parameters())
        for pname, p in lazy.named_parameters():
            assert getattr(p, "tp_split", None) == getattr(par_params[pname], "tp_split", None), pname
            torch.testing.assert_close(p, par_params[pname], rtol=0, atol=0, msg=f"{name} lazy {pname}")
        # forward and backward
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)
        targets = torch.randint(0, cfg.vocab_size, (3, 16), generator=gen)
        targets[0, :4] = -100  # ignored positions
        torch.testing.assert_close(par(idx), ref(idx), **TOL)
        loss_ref, loss_par = ref(idx, targets), par(idx, targets)
        torch.testing.assert_close(loss_par, loss_ref, **TOL)
        loss_ref.backward()
        loss_par.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for pname, grad in _gathered(par, g, grads=True).items():
            torch.testing.assert_close(grad, ref_grads[pname], **TOL, msg=f"{name} grad {pname}")
        # ten AdamW steps on two alternating batches (learnable, so the loss must fall).
        # NOTE: Adam divides by sqrt(v): a gradient element near zero turns rounding differences
        # between the two runs (different summation order) into differences of order lr. Hence
        # eps=1e-6, not 1e-8 (the key bias's true gradient is exactly zero: softmax ignores a
        # shift of all scores, so its gradient is pure rounding noise, ~1e-9), and lr=3e-3: at
        # 1e-2 the tied model's losses drift apart by up to 5e-5 by step 9, from 5e-7 at step 4.
        opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
                for m in (ref, par)]
        batches = [torch.randint(0, cfg.vocab_size, (3, 16), generator=gen) for _ in range(2)]
        history = []
        for step in range(10):
            idx = batches[step % 2]
            targets = torch.roll(idx, -1, dims=1)
            losses = []
            for model, opt in zip((ref, par), opts):
                opt.zero_grad()
                loss = model(idx, targets)
                loss.backward()
                opt.step()
                losses.append(loss)
            torch.testing.assert_close(losses[1], losses[0], **TOL, msg=lambda m: f"{name} step {step}: {m}")
            history.append(losses[0].item())
        assert history[-1] < history[0] - 0.5, history  # it did train
        for pname, full in _gathered(par, g).items():
            torch.testing.assert_close(full, ref_params[pname], **TOL, msg=f"{name} trained {pname}")


def _replicas_stay_identical_with_dropout(rank: int, world: int) -> None:
    """With dropout, TP and single process draw different masks, but the TP ranks must stay in step:
    replicated tensors (norms, row-parallel biases, position embedding) identical on every rank."""
    g = init_parallel(tp_size=2).tp_group
    cfg = dataclasses.replace(CONFIGS["untied"], dropout=0.2)
    torch.manual_seed(3)  # the same seed on every TP rank (the caller's duty)
    model = GPT(cfg, seed=7, tp_group=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    for _ in range(3):
        opt.zero_grad()
        model(idx, torch.roll(idx, -1, dims=1)).backward()
        opt.step()
    replicated = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "tp_split")
                  or p.tp_split[2] == 1]
    assert any(n == "blocks.0.attn.proj.bias" for n, _ in replicated)
    for pname, p in replicated:
        copies = [torch.empty_like(p) for _ in range(2)]
        torch.distributed.all_gather(copies, p.detach(), group=g)
        torch.testing.assert_close(copies[0], copies[1], rtol=0, atol=0, msg=pname)


def _tp2_checks(rank: int, world: int) -> None:
    _equal_to_single_process(rank, world)
    _replicas_stay_identical_with_dropout(rank, world)


def test_tp2_gpt_equals_single_process_and_replicas_stay_in_step():
    run_ranks(_tp2_checks, 2)
