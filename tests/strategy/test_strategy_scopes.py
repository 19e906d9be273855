"""Whale's scopes -> Layout: nesting, defaults, stage membership, TP degree, DP size, bad annotations."""

from __future__ import annotations

import pytest
from torch import nn

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from pystronghold.strategy import Layout, annotate, layout_of, set_default_strategy, strategy_of

CFG = GPTConfig(vocab_size=97, vocab_pad_multiple=2, seq_len=16, layers=4, hidden=32, heads=4)


class TwoPart(nn.Module):
    """A head, blocks built by the caller's code, a tail: what a user model looks like."""

    def __init__(self, build_blocks):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = build_blocks()
        self.head = nn.Linear(8, 10)


@pytest.fixture(autouse=True)
def _default_restored():
    yield
    set_default_strategy(None)


def test_no_scope_is_plain_data_parallelism():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    layout = layout_of(model)
    assert layout.dp_size is None and layout.pp_size == 1 and layout.num_micro_batch == 1
    assert layout.stages[0].modules == ("0", "1") and layout.stages[0].tp_size == 1
    assert layout_of(model, world_size=3).dp_size == 3


def test_issue_example_replicate_two_stages_split_in_the_second():
    def blocks():
        with ph.replicate(4):
            with ph.stage():
                first = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
            with ph.stage():
                with ph.split(2):
                    last = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        return nn.ModuleList([*first, *last])

    model = TwoPart(blocks)
    layout = layout_of(model)
    assert layout.dp_size == 4 and layout.pp_size == 2 and layout.num_micro_batch == 1
    # the embedding joins the first stage, the unannotated head the last (module order)
    assert layout.stages[0].modules == ("embed", "blocks.0", "blocks.1")
    assert layout.stages[1].modules == ("blocks.2", "blocks.3", "head")
    assert [s.tp_size for s in layout.stages] == [1, 2]
    assert layout.devices_per_replica == 3 and layout.world_size == 12
    # stage 0: ranks 0..3 (one per replica); stage 1: ranks 4..11, two per replica
    assert layout.stage_ranks(1, 0) == [1] and layout.stage_ranks(1, 1) == [6, 7]
    assert layout.dp_groups() == [[0, 1, 2, 3], [4, 6, 8, 10], [5, 7, 9, 11]]


def test_pipeline_micro_batches_and_gpt_blocks_annotated_after_construction():
    model = GPT(CFG, seed=0)
    with ph.replicate(2), ph.pipeline(4):
        with ph.stage():
            annotate(model.head, *model.blocks[:3])
        with ph.stage():
            annotate(*model.blocks[3:])  # the tail joins the last stage unannotated
    layout = layout_of(model, world_size=4)
    assert layout.num_micro_batch == 4 and layout.dp_size == 2 and layout.pp_size == 2
    assert layout.stage_of("blocks.2.mlp.fc2") == 0 and layout.stage_of("blocks.3.ln1") == 1
    assert layout.stage_of("tail.ln_f") == 1 and layout.stage_of("head.tok") == 0
    owners = [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    assert sorted(sum((s.modules for s in layout.stages), ())) == sorted(owners)  # each module once


def test_modules_built_inside_a_scope_are_annotated_without_their_code_changing():
    with ph.split(2):
        lin = nn.Linear(3, 3)
    outside = nn.Linear(3, 3)
    assert [s.kind for s in strategy_of(lin)] == ["split"] and strategy_of(outside) == ()
    assert layout_of(nn.Sequential(lin, outside)).stages[0].tp_size == 2


def test_default_strategy_sets_the_dp_size_of_unannotated_modules():
    set_default_strategy(lambda: ph.replicate(3))
    layout = layout_of(nn.Linear(2, 2))
    assert layout.dp_size == 3 and isinstance(layout, Layout)
    with pytest.raises(ValueError, match="the world size is 4"):
        layout.resolve(4)


@pytest.mark.parametrize("build, message", [
    (lambda: _nest(ph.stage(), ph.replicate(2)), r"replicate\(2\) inside stage\(\): replicate must be the outermost"),
    (lambda: _nest(ph.split(2), ph.stage()), r"stage\(\) inside split\(2\): a stage may not be inside"),
    (lambda: _nest(ph.stage(), ph.stage()), r"stage\(\) inside stage\(\)"),
    (lambda: _nest(ph.split(2), ph.split(2)), r"split\(2\) inside split\(2\): splits do not nest"),
    (lambda: _nest(ph.stage(), ph.pipeline(2)), r"pipeline\(num_micro_batch=2\) inside stage\(\)"),
    (lambda: ph.split(0), r"split: device_count must be a positive int, got 0"),
    (lambda: ph.pipeline(1.5), r"pipeline: num_micro_batch must be a positive int, got 1.5"),
    (lambda: ph.replicate(True), r"replicate: device_count must be a positive int or None"),
], ids=["replicate-in-stage", "stage-in-split", "stage-in-stage", "split-in-split", "pipeline-in-stage",
        "split-0", "micro-float", "replicate-bool"])
def test_bad_nesting_is_one_error_naming_the_scope(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def _nest(outer, inner):
    with outer:
        with inner:
            nn.Linear(1, 1)


def _two_dp_sizes():
    with ph.replicate(2):
        a = nn.Linear(2, 2)
    with ph.replicate(4):
        b = nn.Linear(2, 2)
    return nn.Sequential(a, b)


def _two_tp_degrees_in_a_stage():
    with ph.stage():
        with ph.split(2):
            c = nn.Linear(2, 2)
        with ph.split(4):
            d = nn.Linear(2, 2)
    return nn.Sequential(c, d)


def _pipeline_module_in_no_stage():
    with ph.pipeline(2):
        return nn.Sequential(nn.Linear(2, 2))


def _stages_of_two_pipelines():
    with ph.pipeline(2), ph.stage():
        f = nn.Linear(2, 2)
    with ph.stage():
        g = nn.Linear(2, 2)
    return nn.Sequential(f, g)


@pytest.mark.parametrize("build, message", [
    (_two_dp_sizes, r"replicate\(2\) on '0' and replicate\(4\) on '1'"),
    (_two_tp_degrees_in_a_stage, r"stage 0 has split\(2\) on '0' and split\(4\) on '1'"),
    (_pipeline_module_in_no_stage, r"inside pipeline\(num_micro_batch=2\) but in no stage"),
    (_stages_of_two_pipelines, "stages of two pipelines"),
], ids=["dp-sizes", "tp-degrees", "no-stage", "two-pipelines"])
def test_conflicting_annotations_are_refused_at_layout_time(build, message):
    model = build()
    with pytest.raises(ValueError, match=message):
        layout_of(model)


def test_misused_scopes_are_refused_with_one_line():
    with pytest.raises(ValueError, match="annotate\\(\\) must be called inside"):
        annotate(nn.Linear(1, 1))
    with ph.stage(), pytest.raises(TypeError, match="expected nn.Module, got int"):
        annotate(3)
    with pytest.raises(ValueError, match=r"only replicate\(n\) can be the default, got stage\(\)"):
        set_default_strategy(ph.stage)
    with pytest.raises(ValueError, match="world size 5 is not a multiple of the 2 devices"):
        with ph.split(2):
            lin = nn.Linear(2, 2)
        layout_of(lin, world_size=5)


def _init_layout_dp_tp(rank: int, world: int) -> None:
    from pystronghold.strategy import init_layout

    with ph.replicate(2), ph.split(2):
        model = nn.Linear(2, 2)
    groups = init_layout(layout_of(model, world_size=world), heads=4)
    assert (groups.tp_size, groups.dp_size, groups.tp_rank, groups.dp_rank) == (2, 2, rank % 2, rank // 2)


def test_init_layout_makes_the_tp_and_dp_groups_of_the_scopes():
    from _dist import run_ranks

    run_ranks(_init_layout_dp_tp, 4, timeout_s=120)


def test_block_ranges_for_the_pipeline_runtime():
    model = GPT(CFG, seed=0)
    with ph.pipeline(4):
        with ph.stage():
            annotate(model.head, *model.blocks[:1])
        with ph.stage():
            annotate(*model.blocks[1:])
    layout = layout_of(model, world_size=2)
    assert layout.block_ranges(model, model.blocks) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="blocks is not a submodule"):
        layout.block_ranges(model, nn.ModuleList())


@pytest.mark.parametrize("assign, message", [
    (lambda m: ([m.blocks[0], m.blocks[2]], [m.blocks[1], m.blocks[3]]), r"do not run 0..1 in block order"),
    (lambda m: ([m.blocks[0], m.blocks[1].ln1], [m.blocks[1], *m.blocks[2:]]), r"block blocks.1 is spread over stages \[0, 1\]"),
    (lambda m: ([*m.blocks[:2]], [m.head, *m.blocks[2:]]), r"module 'head.tok' comes before the first block"),
], ids=["interleaved", "split-block", "head-on-last-stage"])
def test_block_ranges_refuses_what_is_not_a_pipeline(assign, message):
    model = GPT(CFG, seed=0)
    first, second = assign(model)
    with ph.stage():
        annotate(*first)
    with ph.stage():
        annotate(*second)
    with pytest.raises(ValueError, match=message):
        layout_of(model).block_ranges(model, model.blocks)
