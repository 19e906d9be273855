"""Pipeline parallelism (PP) through the window runtime, on real gloo processes.

Every run is compared with plain PyTorch training of the single-process model on the same global
batch (the mean loss of the whole batch; clipping by ``clip_grad_norm_``). Stated tolerances (fp32):
rtol 1e-6 on losses and gradient norms (the pipeline sums the same products per micro-batch, then
over micro-batches: rounding only), and the parameter tolerance of test_parallel_runtime (rtol and
atol 1e-5: Adam divides by sqrt(v), so an element whose gradient is near zero turns rounding into
a parameter difference). One AdamW step moves a weight by ~lr = 3e-3, 300 times that tolerance, so
a stage that does not train, a missing tied-gradient sum or a wrong micro-batch scale fails.
The model ties its embeddings (first stage) to its LM head (last stage).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from parallel_training import single_process_run

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.options import ConfigError
from pystronghold.parallel import gather_tp_param, init_parallel, validate_parallel_sizes
from pystronghold.pipelining import Pipeline, gpt_chunks, gpt_loss, gpt_stage
from pystronghold.planner.pipeline import rank_passes, stage_passes
from pystronghold.settings.parallel import ParallelOptions, check_pipeline

CFG = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=4, hidden=32, heads=4,
                tie_embeddings=True)
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
TOL = dict(rtol=1e-6, atol=1e-7)
PARAM_TOL = dict(rtol=1e-5, atol=1e-5)
CLIP = 0.05  # below every step's gradient norm (asserted), so clipping changes every update
MICRO = 4


def _data(steps: int, batch: int) -> torch.Tensor:
    """(steps, batch, T + 1) token ids: inputs are [..., :-1], targets [..., 1:]."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (steps, batch, CFG.seq_len + 1), generator=g)


def _train(groups, data: torch.Tensor, schedule: str = "1f1b", chunks: int = 1, **options):
    """This rank's stage (``chunks`` model chunks) trained on its replica's slice: (global mean
    losses, grad norms, the whole model's fp32 masters gathered from every stage and TP rank, the
    pipeline's engine stats)."""
    cfg = dataclasses.replace(CFG, tp_size=groups.tp_size)
    model = GPT(cfg, seed=7, tp_group=groups.tp_group)
    stage, tied = gpt_chunks(model, groups, chunks=chunks)
    pipe = Pipeline(stage, groups, loss_fn=gpt_loss(cfg, groups.tp_group), micro_batches=MICRO,
                    hidden=cfg.hidden, output_size=cfg.padded_vocab_size // groups.tp_size,
                    schedule=schedule, tied=tied, window=1, strict=True, optimizer=ph.AdamW(**HYPER),
                    **options)
    per = data.shape[1] // groups.dp_size
    mine = data[:, groups.dp_rank * per:(groups.dp_rank + 1) * per]
    losses, norms = [], []
    try:
        for tokens in mine:
            loss = torch.tensor([pipe.step(tokens[:, :-1], tokens[:, 1:])], dtype=torch.float64)
            if groups.dp_size > 1:
                dist.all_reduce(loss, group=groups.dp_group)
            losses.append(float(loss) / groups.dp_size)
            norms.append(pipe.engine.grad_norm)
        tokens = mine[0]
        validation = pipe.evaluate(tokens[:, :-1], tokens[:, 1:])  # after training: the trained model's
        local = {}
        for name, value in pipe.master_parameters().items():
            value = value.clone()
            value.tp_split = getattr(model.get_parameter(name), "tp_split", (0, 0, 1))
            local[name] = gather_tp_param(value, groups.tp_group)
        stats = dict(pipe.engine.stats(), validation=validation, passes=pipe.passes)
    finally:
        pipe.close()
    parts = [None] * groups.pp_size
    dist.all_gather_object(parts, local, group=groups.pp_group)
    params = {k: v for part in parts for k, v in part.items()}
    return losses, norms, params, stats


def _assert_matches(got, ref) -> None:
    (losses, norms, params, _), (ref_losses, ref_norms, ref_params) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    assert min(ref_norms) > CLIP, ref_norms  # clipping really changed every step
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), **TOL)
    # the last stage's LM head is its own copy of the embedding: trained to the same values
    assert params.keys() == ref_params.keys() | {"tail.lm_head.weight"}
    torch.testing.assert_close(params["tail.lm_head.weight"], ref_params["head.tok.weight"], **PARAM_TOL)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, **PARAM_TOL, msg=lambda m: f"{name}: {m}")


def _pp(rank: int, world: int, tp: int, schedules: tuple[str, ...]) -> None:
    groups = init_parallel(tp, pp=2, heads=CFG.heads, timeout_s=30)
    data = _data(steps=3, batch=2 * MICRO * groups.dp_size)
    ref = single_process_run(data.unsqueeze(1), CLIP, config=CFG)
    for schedule in schedules:  # interleaved: two model chunks per rank
        got = _train(groups, data, schedule, chunks=2 if schedule == "interleaved" else 1, clip_grad_norm=CLIP)
        _assert_matches(got, ref)


def _pp_interleaved(rank: int, world: int) -> None:
    """Two model chunks per rank (virtual stages 0-3 of one block each): the same losses, norms
    and parameters as a single process; with the first chunk of each rank resident (K=1) too; the
    validation loss equals the 1F1B pipeline's; the rank's passes are torch's and the planner's
    in-flight figure is their peak."""
    from pystronghold.planner.pipeline import in_flight_micro_batches

    groups = init_parallel(1, pp=2, heads=CFG.heads, timeout_s=30)
    data = _data(steps=3, batch=2 * MICRO)
    ref = single_process_run(data.unsqueeze(1), CLIP, config=CFG)
    plain = _train(groups, data, "1f1b", clip_grad_norm=CLIP)
    for options in ({}, {"resident_blocks": 1}):
        got = _train(groups, data, "interleaved", chunks=2, clip_grad_norm=CLIP, **options)
        _assert_matches(got, ref)
        stats = got[3]
        assert stats["resident_blocks"] == options.get("resident_blocks", 0)
        assert abs(stats["validation"] - plain[3]["validation"]) <= 1e-6 * plain[3]["validation"]
        passes = stats["passes"]
        assert sorted(passes) == sorted((c, k) for c in (0, 1) for k in ("fwd", "bwd") for _ in range(MICRO))
        held, peak = 0, 0
        for _, kind in passes:
            held += 1 if kind == "fwd" else -1
            peak = max(peak, held)
        assert peak == in_flight_micro_batches("interleaved", groups.pp_rank, 2, MICRO, chunks=2)


def test_pp2_interleaved_two_chunks_equals_single_process():
    run_ranks(_pp_interleaved, 2, timeout_s=150)


def _stages_out_of_order(rank: int, world: int) -> None:
    """Chunks given in another order than the virtual stages', or ranks holding blocks out of
    model order: every rank raises (before any engine is built) instead of training a model whose
    activations reach the wrong blocks."""
    groups = init_parallel(1, pp=2, timeout_s=30)
    model = GPT(dataclasses.replace(CFG, tie_embeddings=False), seed=7)
    chunks, _ = gpt_chunks(model, groups, chunks=2)
    kwargs = dict(loss_fn=gpt_loss(model.config, None), micro_batches=MICRO, hidden=CFG.hidden,
                  output_size=model.config.padded_vocab_size, window=1)
    with pytest.raises(ValueError, match=r"the stages must hold the model in order: .*stage 2: head \+ blocks \[0\]"):
        Pipeline(chunks[::-1], groups, schedule="interleaved", **kwargs)
    from pystronghold.pipelining import build_stage

    swapped = build_stage(None, [model.blocks[1 - groups.pp_rank]], None, first_block=1 - groups.pp_rank)
    with pytest.raises(ValueError, match=r"stage 0: blocks \[1\]; stage 1: blocks \[0\]"):
        Pipeline(swapped, groups, **kwargs)


def test_stages_out_of_model_order_are_refused_on_every_rank():
    run_ranks(_stages_out_of_order, 2, timeout_s=120)


def test_pp2_1f1b_and_gpipe_equal_single_process():
    run_ranks(_pp, 2, 1, ("1f1b", "gpipe"), timeout_s=150)


def _pp_on_torch_2_11s_stage(rank: int, world: int) -> None:
    """As under torch 2.11 (the GPU machine's): its PipelineStage takes no gradient shapes, and
    checks the strides of a stage's inputs as well as their shapes."""
    import torch.distributed.pipelining as pipelining

    newer = pipelining.PipelineStage

    class Torch211Stage(newer):
        def __init__(self, submodule, stage_index, num_stages, device, input_args=None, output_args=None,
                     group=None, dw_builder=None):
            first, last = stage_index == 0, stage_index == num_stages - 1
            grads = (dict(input_grads=None if first else input_args.detach(),  # 2.11: the activations'
                          output_grads=None if last else output_args)
                     if "input_grads" in inspect.signature(newer).parameters else {})  # (on 2.11 itself)
            super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                             output_args=output_args, group=group, dw_builder=dw_builder, **grads)

        def forward_one_chunk(self, fwd_chunk_id, args, *rest, **options):
            for arg in args:
                assert arg.is_contiguous(), f"stage {self.stage_index}: input of stride {arg.stride()}"
            return super().forward_one_chunk(fwd_chunk_id, args, *rest, **options)

    pipelining.PipelineStage = Torch211Stage
    try:
        groups = init_parallel(1, pp=2, heads=CFG.heads, timeout_s=30)
        data = _data(steps=2, batch=2 * MICRO)  # inputs tokens[:, :-1]: a slice of stride T + 1
        _assert_matches(_train(groups, data, "1f1b", clip_grad_norm=CLIP),
                        single_process_run(data.unsqueeze(1), CLIP, config=CFG))
    finally:
        pipelining.PipelineStage = newer


def test_pp2_trains_on_torch_2_11s_pipeline_stage():
    run_ranks(_pp_on_torch_2_11s_stage, 2, timeout_s=120)


def test_pp2_tp2_equals_single_process():
    run_ranks(_pp, 4, 2, ("1f1b", "interleaved"), timeout_s=150)


def test_pp2_dp2_equals_single_process():
    run_ranks(_pp, 4, 1, ("1f1b", "interleaved"), timeout_s=150)


def _fp16_overflow_on_one_stage(rank: int, world: int) -> None:
    """An inf in the last stage's LM-head gradient only (the activations' gradients stay finite):
    every stage skips that step and halves its loss scale."""
    groups = init_parallel(1, pp=2, timeout_s=30)
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    model = GPT(cfg, seed=7)
    stage, tied = gpt_stage(model, groups)
    pipe = Pipeline(stage, groups, loss_fn=gpt_loss(cfg, None), micro_batches=2, hidden=cfg.hidden,
                    output_size=cfg.padded_vocab_size, window=1, precision="fp16",
                    optimizer=ph.AdamW(**HYPER))
    poison = {"on": False}
    if groups.pp_rank == 1:
        model.tail.lm_head.weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)
    try:
        for step, tokens in enumerate(_data(steps=3, batch=4)):
            poison["on"] = step == 1
            pipe.step(tokens[:, :-1], tokens[:, 1:])
        stats = pipe.engine.stats()
        assert (stats["steps"], stats["skipped_steps"]) == (2, 1), stats
    finally:
        pipe.close()
    scales = [None, None]
    dist.all_gather_object(scales, stats["loss_scale"])
    assert scales[0] == scales[1]


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage():
    run_ranks(_fp16_overflow_on_one_stage, 2, timeout_s=120)


# ---- without processes


def test_stage_passes_follow_torch_schedules():
    assert stage_passes("1f1b", 0, 2, 4) == ["fwd", "fwd", "bwd", "fwd", "bwd", "fwd", "bwd", "bwd"]
    assert stage_passes("1f1b", 1, 2, 4) == ["fwd", "bwd"] * 4
    assert stage_passes("gpipe", 1, 2, 2) == ["fwd", "fwd", "bwd", "bwd"]


def test_a_stage_run_in_another_order_than_its_plan_raises():
    """The engine checks every block use against the step plan: a schedule that runs the passes
    in another order fails loudly instead of computing with the wrong blocks."""
    from pystronghold.runtime.streaming.schedule import pass_uses, plan_uses

    model = GPT(dataclasses.replace(CFG, tie_embeddings=False), seed=7)
    engine = ph.wrap(model, blocks=model.blocks, window=2, accumulation_steps=2)
    try:
        engine.use_step_plan(plan_uses(pass_uses([(kind, range(4)) for kind in ("fwd", "fwd", "bwd", "bwd")]), 2))
        tokens = _data(steps=1, batch=2)[0]
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        with pytest.raises(RuntimeError, match="out of the expected order"):
            loss.backward()
    finally:
        engine.close()


def test_bad_pipeline_layouts_raise_naming_the_size():
    with pytest.raises(ValueError, match="pp_size=2 x tp_size=1 x dp_size=1 = 2 processes, but the world size is 4"):
        validate_parallel_sizes(4, 1, 1, pp_size=2)
    with pytest.raises(ValueError, match="pp_size=3 x tp_size=1 must divide the world size 4"):
        validate_parallel_sizes(4, 1, pp_size=3)
    assert validate_parallel_sizes(8, 2, pp_size=2) == 2


@pytest.mark.parametrize("settings, blocks, message", [
    (dict(pp=5), 4, "ParallelOptions.pp=5 stages are more than the model's 4 blocks"),
    (dict(pp=2, micro_batches=1), None, "ParallelOptions.micro_batches=1 must be at least pp=2 stages"),
    (dict(pp=2, pp_schedule="zero-bubble"), None, "ParallelOptions.pp_schedule must be one of"),
    (dict(pp=4, micro_batches=6, pp_schedule="interleaved", pp_chunks=2), None,
     "ParallelOptions.micro_batches=6 must be a multiple of pp=4 stages for the interleaved"),
    (dict(pp=2, pp_schedule="interleaved", pp_chunks=3), 4,
     "ParallelOptions.pp=2 stages x pp_chunks=3 = 6 model chunks are more than the model's 4 blocks"),
    (dict(pp=2, pp_schedule="interleaved"), None, "ParallelOptions.pp_chunks=1 must be >= 2 with pp_schedule="),
    (dict(pp=2, pp_schedule="gpipe", pp_chunks=2), None, "ParallelOptions.pp_chunks=2 needs pp_schedule='interleaved'"),
    (dict(pp=1, pp_schedule="interleaved", pp_chunks=2), None, "ParallelOptions.pp_chunks=2 needs a pipeline"),
])
def test_check_pipeline_names_the_setting_that_does_not_fit(settings, blocks, message):
    with pytest.raises(ConfigError, match=message):
        check_pipeline(ParallelOptions(**settings), blocks)


def test_check_pipeline_passes_a_layout_that_fits():
    check_pipeline(ParallelOptions(pp=2, micro_batches=4, pp_schedule="interleaved", pp_chunks=2), 4)


def test_rank_passes_read_torchs_actions_and_refuse_a_split_backward():
    """Virtual stage s is chunk s // p; idle slots are skipped; a zero-bubble schedule's input and
    weight backwards (I, W) would run each block's backward twice: refused."""
    from types import SimpleNamespace as Action

    actions = [None, Action(stage_index=1, computation_type="F"), Action(stage_index=3, computation_type="F"),
               Action(stage_index=3, computation_type="B"), None, Action(stage_index=1, computation_type="B")]
    assert rank_passes(actions, 2) == [(0, "fwd"), (1, "fwd"), (1, "bwd"), (0, "bwd")]
    with pytest.raises(ValueError, match="not a forward .F. or a full backward .B."):
        rank_passes([Action(stage_index=1, computation_type="I")], 2)


@pytest.mark.parametrize("split", [[range(0, 2), range(3, 4)], [range(0, 2), range(2, 3)], [range(0, 0), range(0, 4)],
                                   [range(0, 3), range(2, 4)]], ids=["gap", "short", "empty", "overlap"])
def test_gpt_stage_refuses_a_split_that_does_not_cover_the_blocks_once(split):
    """A given split (whale's stage() scopes) must hold every block exactly once, in order: else a
    block would be trained twice or never, silently."""
    from pystronghold.parallel.groups import ParallelGroups

    groups = ParallelGroups(rank=0, world_size=2, tp_size=1, dp_size=1, tp_rank=0, dp_rank=0, tp_group=None,
                            dp_group=None, pp_size=2, pp_rank=0)
    with pytest.raises(ValueError, match="split must be contiguous non-empty ranges covering blocks 0..3"):
        gpt_stage(GPT(CFG, seed=7), groups, split=split)
