"""Device-resident blocks (``resident_blocks=K``): the first K blocks stay on the device with a device
AdamW; exactness against plain PyTorch, recompute only where asked, state and checkpoints that do not
depend on K."""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch

import pystronghold as ph
from pystronghold.runtime.memory.layout import head_tail_bytes
from runtime_models import (HYPER, HetStack, assert_same_mixed_training, assert_same_training, engine_steps,
                            gpt_batches, het_batches, one_torch_thread, plain_steps, run_both, tiny_gpt,
                            train_engine, train_mixed_reference)
from train_helpers import run_training, tiny_config

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def test_every_block_resident_without_recompute_is_plain_pytorch_bit_for_bit():
    """W=all, K=N, no recompute: 20 fp32 steps give the same losses and parameters, bit for bit."""
    (ref_losses, ref_params), (losses, params, engine) = run_both(
        tiny_gpt, gpt_batches(20), window="all", resident_blocks=8)
    assert losses == ref_losses
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), name
    st = engine.stats()
    assert (st["resident_blocks"], st["streamed_blocks"], st["window"], st["peak_resident"]) == (8, 0, 0, 0)


@pytest.mark.parametrize("k, window, clip, accumulation, recompute", [
    (2, 2, None, 1, False), (5, 1, 0.05, 1, True), (3, "all", 0.05, 2, False), (7, 1, None, 2, False)])
def test_some_blocks_resident_match_pytorch(k, window, clip, accumulation, recompute):
    ref, got = run_both(tiny_gpt, gpt_batches(20 if accumulation == 1 else 24), window=window, resident_blocks=k,
                        clip=clip, accumulation=accumulation, resident_recompute=recompute, strict=True)
    assert_same_training(ref, got)
    assert got[2].stats()["streamed_blocks"] == 8 - k


def test_heterogeneous_blocks_resident_with_clipping():
    ref, got = run_both(HetStack, het_batches(12), window=2, resident_blocks=3, clip=0.1)
    assert_same_training(ref, got)


def test_bf16_resident_blocks_match_the_mixed_precision_recipe():
    model, batches = tiny_gpt(), gpt_batches(20)
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.bfloat16, clip=0.5)
    got = train_engine(model, batches, window=2, precision="bf16", clip_grad_norm=0.5, resident_blocks=3)
    assert_same_mixed_training(ref, got)
    assert all(p.dtype == torch.bfloat16 for p in model.blocks[0].parameters())


def test_fp16_overflow_skips_resident_blocks_too():
    model, batches = tiny_gpt(), gpt_batches(12)
    init = 2.0**40
    ref = train_mixed_reference(copy.deepcopy(model), batches, torch.float16, init_scale=init)
    got = train_engine(model, batches, window=2, precision="fp16", initial_loss_scale=init, resident_blocks=4)
    assert got[2].skipped_steps == ref[2] >= 1
    assert_same_mixed_training(ref, got)


def test_every_block_resident_counts_plain_loss_backward_with_accumulation():
    """K=N: ``loss.backward()`` (not only ``engine.backward``) counts as a micro-batch."""
    model, batches = tiny_gpt(layers=2), gpt_batches(4)
    ref = copy.deepcopy(model)
    engine = ph.wrap(model, window="all", resident_blocks=2, accumulation_steps=2,
                     optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    try:
        for k, (x, y) in enumerate(batches):
            engine(x, y).backward()
            ref(x, y).backward()
            if k % 2 == 1:
                engine.step(), opt.step()
                engine.zero_grad(), opt.zero_grad()
        assert engine.stats()["steps"] == 2
        for name, p in ref.named_parameters():
            assert torch.equal(dict(model.named_parameters())[name], p), name
    finally:
        engine.close()


def _counting_forward(block):
    calls = []
    original = block.forward

    def forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    block.forward = forward
    return calls


@pytest.mark.parametrize("recompute", [False, True])
def test_resident_blocks_recompute_only_when_asked(recompute):
    model = tiny_gpt(layers=4)
    resident_calls, streamed_calls = _counting_forward(model.blocks[0]), _counting_forward(model.blocks[3])
    train_engine(model, gpt_batches(2), window=1, resident_blocks=2, resident_recompute=recompute)
    assert len(resident_calls) == (4 if recompute else 2)
    assert len(streamed_calls) == 4  # streamed blocks recompute (checkpointing=True)


def test_stats_and_log_line_give_the_split(caplog):
    model = tiny_gpt(layers=4)
    resident = [p for b in model.blocks[:3] for p in b.parameters()]
    expected = head_tail_bytes(resident, torch.float32)
    with caplog.at_level(logging.INFO, logger="pystronghold.runtime.engine"):
        engine = ph.wrap(model, window=1, resident_blocks=3)
    try:
        st = engine.stats()
        assert (st["blocks"], st["resident_blocks"], st["streamed_blocks"], st["window"]) == (4, 3, 1, 1)
        assert st["resident_bytes"] == expected
        assert st["store_bytes"] > 0
        assert (f"3 resident with device AdamW ({expected} bytes, activations kept), 1 streamed (W=1, "
                f"device arena {st['planned_arena_bytes']} bytes, host store {st['store_bytes']} bytes, "
                "recomputed)") in caplog.text
    finally:
        engine.close()


def test_trace_numbers_streamed_blocks_as_the_model_does():
    _, _, engine = train_engine(tiny_gpt(layers=4), gpt_batches(2), window=1, resident_blocks=3, trace=True)
    blocks = {e.block for e in engine.trace.events() if e.block is not None}
    assert blocks == {3}  # the one streamed block; resident blocks are not scheduled


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_resident_blocks_is_refused(bad):
    with pytest.raises(ValueError, match="resident_blocks"):
        ph.wrap(tiny_gpt(layers=2), resident_blocks=bad)


def test_more_resident_blocks_than_blocks_is_refused():
    with pytest.raises(ValueError, match="resident_blocks=5 is more than the 4 blocks"):
        ph.wrap(tiny_gpt(layers=4), resident_blocks=5)


@pytest.mark.parametrize("k", [2, 4])
def test_torch_state_dicts_load_into_resident_blocks_and_back(k):
    """Plain PyTorch's model and AdamW state dicts load into an engine with K resident blocks, which
    continues as plain PyTorch does; the engine's state dicts load back into plain PyTorch."""
    first, then = gpt_batches(3, seed=5), gpt_batches(4, seed=6)
    model = tiny_gpt(layers=4)
    plain, plain_opt = copy.deepcopy(model), None
    plain_opt = torch.optim.AdamW(plain.parameters(), **HYPER)
    plain_steps(plain, plain_opt, first)
    engine = ph.wrap(model, window=2, resident_blocks=k, optimizer=ph.AdamW(**HYPER, bitwise_torch=True))
    try:
        model.load_state_dict(plain.state_dict())
        engine.optimizer.load_state_dict(plain_opt.state_dict())
        want = plain_steps(plain, plain_opt, then)
        assert engine_steps(engine, then) == want
        again = copy.deepcopy(plain)  # any values: they are overwritten by the load
        again_opt = torch.optim.AdamW(again.parameters(), **HYPER)
        again.load_state_dict(model.state_dict())
        again_opt.load_state_dict(engine.optimizer.state_dict())
        more = gpt_batches(2, seed=7)
        assert plain_steps(again, again_opt, more) == plain_steps(plain, plain_opt, more)
    finally:
        engine.close()


@pytest.mark.parametrize("k_before, k_after", [(2, 0), (0, 2), (4, 1)])
def test_checkpoint_resumes_with_another_number_of_resident_blocks(tmp_path, k_before, k_after):
    straight = run_training(tiny_config(tmp_path, steps=6, resident=k_before))
    ck = tmp_path / "ck"
    run_training(tiny_config(tmp_path, steps=6, ckpt=str(ck), every=3, resident=k_before))
    shutil.rmtree(ck / "step-00000006")
    resumed = run_training(tiny_config(tmp_path, steps=6, ckpt=str(ck), resume=True, resident=k_after))
    assert resumed.start_step == 3
    torch.testing.assert_close(torch.tensor(resumed.losses, dtype=torch.float64),
                               torch.tensor(straight.losses[3:], dtype=torch.float64), rtol=1e-6, atol=0)


def test_cli_resident_blocks_flag():
    from pystronghold.cli import build_parser
    from pystronghold.train.command import config_from_args

    def config(*argv):
        return config_from_args(build_parser().parse_args(["train", *argv]))

    assert config("--resident-blocks", "3").runtime.resident_blocks == 3
    assert config().runtime.resident_blocks == 0
    assert config("--window", "auto", "--resident-blocks", "auto").runtime.resident_blocks == "auto"
    with pytest.raises(ValueError, match="^--resident-blocks must be an int >= 0 or 'auto', got -1$"):
        config("--resident-blocks", "-1")
    # K is chosen together with W: with a fixed window it would reach wrap unresolved (after the data)
    with pytest.raises(ValueError, match="^--resident-blocks auto is chosen together with the window: "
                                         "it needs --window auto"):
        config("--window", "4", "--resident-blocks", "auto")


def test_wrap_refuses_resident_blocks_auto():
    """'auto' is the planner's to resolve (plan, train --window auto); wrap takes a number."""
    import pystronghold as ph
    from runtime_models import tiny_gpt

    model = tiny_gpt()
    with pytest.raises(ValueError, match="resident_blocks='auto' is chosen by the planner"):
        ph.wrap(model, blocks=model.blocks, window=2, resident_blocks="auto")


def test_lazy_blocks_materialize_into_resident_and_streamed_blocks():
    """Blocks built on the meta device: resident block i and streamed block j get the values block i
    and j have in an eagerly built model (each materialized with its own global index)."""
    from pystronghold.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=97, seq_len=32, layers=4, hidden=64, heads=4)
    eager = GPT(cfg, seed=3)
    engine = ph.wrap(GPT(cfg, seed=3, materialize_blocks=False), window=1, resident_blocks=2)
    try:
        got = engine.master_parameters()
    finally:
        engine.close()
    for name, p in eager.named_parameters():
        assert torch.equal(got[name], p.detach()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused device AdamW)")
def test_cuda_every_block_resident_is_plain_pytorch_with_fused_adamw():
    """On CUDA, W=all and K=N: the losses and parameters of plain PyTorch + fused AdamW (blocks,
    head and tail run torch's fused kernel, but in separate optimizers over fp32 masters, hence a
    tolerance)."""
    model, batches = tiny_gpt(layers=4), [(x.cuda(), y.cuda()) for x, y in gpt_batches(10)]
    plain = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(plain.parameters(), **HYPER, fused=True)
    want = plain_steps(plain, opt, batches)
    engine = ph.wrap(model, window="all", resident_blocks=4, device="cuda", optimizer=ph.AdamW(**HYPER))
    try:
        torch.testing.assert_close(torch.tensor(engine_steps(engine, batches)), torch.tensor(want),
                                   rtol=1e-6, atol=0)
        got = engine.master_parameters()
        for name, p in plain.named_parameters():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    finally:
        engine.close()


def _parallel_resident(rank: int, world: int, tp: int) -> None:
    """DP (accumulation) and TP x DP (clipping) with 2 of 4 blocks resident, against one process."""
    import dataclasses

    from pystronghold.models import GPT
    from pystronghold.parallel import init_parallel
    from parallel_training import (CFG, CLIP, assert_matches_single_process, assert_replicas_identical,
                                   full_params, parallel_data, single_process_run, train_rank)

    groups = init_parallel(tp_size=tp, heads=CFG.heads, timeout_s=30)
    model = GPT(dataclasses.replace(CFG, tp_size=tp), seed=7, tp_group=groups.tp_group if tp > 1 else None)
    data = parallel_data(steps=3, micro=2 if tp == 1 else 1, batch=2 * groups.dp_size)
    clip = CLIP if tp > 1 else None
    losses, norms, params = train_rank(model, data, groups, resident_blocks=2, clip_grad_norm=clip)
    full = full_params(model, params, groups.tp_group) if tp > 1 else params
    assert_matches_single_process((losses, norms, full), single_process_run(data, clip=clip), clipped=clip is not None)
    if groups.dp_size > 1:
        assert_replicas_identical(params, groups.dp_group)


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)])
def test_resident_blocks_with_data_and_tensor_parallelism(world, tp):
    from _dist import run_ranks

    run_ranks(_parallel_resident, world, tp, timeout_s=150)
