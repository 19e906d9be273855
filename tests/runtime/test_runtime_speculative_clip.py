"""``clip_mode="speculative"``: streamed blocks update during backward assuming clip coefficient 1;
a step that clips (or overflows in fp16) restores their saved pre-step states and redoes the update.

Exact: against torch ``clip_grad_norm_`` + AdamW (fp32, ``assert_same_training``'s tolerance) and
bit for bit against ``clip_mode="after-norm"`` in every other setting (bf16, fp16 with its loss
scale and skipped steps, accumulation, two param groups, resident blocks, the NVMe tier). The
overlap with backward is read from the trace's recorded intervals."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pystronghold as ph
from pystronghold.runtime.optimizer.updates import undo_bytes
from runtime_models import (HYPER, assert_same_training, gpt_batches, one_torch_thread, run_both, tiny_gpt,
                            train_engine, train_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

ALTERNATE = 1.3
"""A max norm that the tiny GPT's gradient norm crosses back and forth in ``gpt_batches(8)``."""


def _record_norms(norms: list):
    """``engine_hook`` that appends each step's global gradient norm to ``norms``."""

    def hook(engine):
        inner = engine.run_step

        def step():
            inner()
            norms.append(engine.grad_norm)

        engine.run_step = step

    return hook


@pytest.mark.parametrize("clip,clipped", [(1e3, "none"), (0.05, "all"), (ALTERNATE, "some")])
def test_speculative_clipping_matches_clip_grad_norm(clip, clipped):
    norms = []
    ref, got = run_both(tiny_gpt, gpt_batches(8), window=2, clip=clip, clip_mode="speculative", strict=True,
                        engine_hook=_record_norms(norms))
    assert_same_training(ref, got)
    assert got[2].overlap == "backward"
    over = [n > clip for n in norms]
    assert {"none": not any(over), "all": all(over), "some": any(over) and not all(over)}[clipped], norms


def _both_modes(batches, **options):
    """The same training with clip_mode "after-norm" and "speculative" (same seeds)."""
    out = []
    for mode in ("after-norm", "speculative"):
        torch.manual_seed(1234)
        model = tiny_gpt()
        torch.manual_seed(1234)
        out.append(train_engine(model, batches, clip_mode=mode, **options))
    return out


def _assert_bit_identical(after, spec):
    assert spec[0] == after[0]  # losses
    for name, p in after[1].items():
        torch.testing.assert_close(spec[1][name], p, rtol=0, atol=0, msg=name)


SETTINGS = {
    "bf16": dict(precision="bf16", clip_grad_norm=ALTERNATE),
    "fp16": dict(precision="fp16"),  # the loss scale's unscale, no clipping
    "fp16-clip": dict(precision="fp16", clip_grad_norm=ALTERNATE),
    "fp16-overflow": dict(precision="fp16", clip_grad_norm=0.05, initial_loss_scale=2.0**40),
    "accumulation": dict(clip_grad_norm=ALTERNATE, accumulation=2),
    "resident": dict(clip_grad_norm=0.05, resident_blocks=2),
    "relay": dict(clip_grad_norm=ALTERNATE, accumulation=2, schedule="relay"),
    "layer-drop": dict(clip_grad_norm=ALTERNATE, layer_drop=0.3),
    "nvme": dict(clip_grad_norm=ALTERNATE, nvme_states="all", nvme_cache_blocks=2),
    "bf16-nvme-clip-all": dict(precision="bf16", clip_grad_norm=0.05, nvme_states="all", nvme_cache_blocks=2),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_speculative_is_bit_identical_to_after_norm(setting, tmp_path):
    options = dict(SETTINGS[setting], window=2)
    if "nvme_states" in options:
        options["nvme_dir"] = str(tmp_path / "nvme")
    after, spec = _both_modes(gpt_batches(8), **options)
    _assert_bit_identical(after, spec)
    if setting == "fp16-overflow":
        assert spec[2].skipped_steps == after[2].skipped_steps > 0


@pytest.mark.parametrize("precision,per_element", [("fp32", 12), ("bf16", 14)])
def test_the_undo_copy_is_what_undo_bytes_says(precision, per_element):
    model = tiny_gpt()
    numels = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    got = train_engine(model, gpt_batches(2), window=2, precision=precision, clip_grad_norm=0.05,
                       clip_mode="speculative")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    assert got[2].stats()["undo_bytes"] == undo_bytes(numels, dtype) == per_element * sum(numels)


def test_two_param_groups_against_torch():
    """Two groups (decay / no decay, their own learning rates) through speculative clipping."""
    torch.manual_seed(0)
    model = tiny_gpt()
    ref_model = copy.deepcopy(model)
    params = list(ref_model.parameters())
    ref_opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2.5e-3}],
                                **HYPER)
    batches = gpt_batches(6)
    ref = train_reference(ref_model, batches, clip=ALTERNATE, optimizer=ref_opt)
    engine = ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=ALTERNATE, clip_mode="speculative",
                     optimizer=ph.AdamW(**HYPER, decay="matrices", bitwise_torch=True))
    engine.optimizer.param_groups[1]["lr"] = 2.5e-3
    losses = []
    try:
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            losses.append(loss.item())
            engine.step()
            engine.zero_grad()
        params = {n: p.clone() for n, p in engine.master_parameters().items()}
    finally:
        engine.close()
    assert_same_training(ref, (losses, params, engine))


# ---- the overlap, from the trace's intervals

class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward calls ``wait()`` first: block 0's backward waits there (bounded) for
    the speculative update of the last block, so the order is fixed by an event, not by timing."""

    @staticmethod
    def forward(ctx, x, wait):
        ctx.wait = wait
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return ctx.wait(grad), None


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.wait = lambda grad: grad  # (gradient in) -> gradient out

    def forward(self, x):
        return _WaitInBackward.apply(x + torch.tanh(self.fc(x)), self.wait)


class _Stack(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.head = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.tail = nn.Linear(d, 1)

    def forward(self, x, y):
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.tail(h), y)


def _one_clipped_step(mode: str):
    """The optimizer spans by block and the end of the last backward span, of one clipped step."""
    model = _Stack()
    engine = ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=1e-3, clip_mode=mode, trace=True)
    last = len(model.blocks) - 1

    def wait_for_last_update(grad):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
                e.kind == "optimizer" and e.block == last for e in engine.trace.events()):
            time.sleep(0.01)
        return grad

    if mode == "speculative":
        model.blocks[0].wait = wait_for_last_update
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)
    try:
        engine.backward(engine(x, y))
        engine.step()
        engine.synchronize()
        events = engine.trace.events()
    finally:
        engine.close()
    opt = {}
    for e in events:
        if e.kind == "optimizer":
            opt.setdefault(e.block, []).append((e.start_s, e.end_s))
    return opt, max(e.end_s for e in events if e.kind == "compute_bwd"), last


def test_speculative_updates_run_under_a_later_backward():
    """The last block's first (speculative) update ends before the step's backward does; after-norm
    starts it only after."""
    opt, bwd_end, last = _one_clipped_step("speculative")
    assert opt[last][0][1] < bwd_end
    assert len(opt[last]) == 2  # the step clipped: undone and redone after the norm
    opt, bwd_end, last = _one_clipped_step("after-norm")
    assert [start > bwd_end for start, _ in opt[last]] == [True]


def test_speculative_needs_the_backward_overlap():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="clip_mode"):
        ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=1.0, clip_mode="speculative", overlap="forward")
    with pytest.raises(ValueError, match="clip_mode"):
        ph.wrap(model, blocks=model.blocks, window=2, clip_mode="later")


def test_auto_speculates_when_the_undo_copy_fits_the_host_budget():
    """clip_mode="auto": speculative with room for the undo copy (and exact), after-norm in a budget
    that holds the store but not the copy."""
    runs = {}
    for mode in ("after-norm", "auto"):
        torch.manual_seed(1234)
        model = tiny_gpt()
        torch.manual_seed(1234)
        runs[mode] = train_engine(model, gpt_batches(4), window=2, clip_grad_norm=0.05, clip_mode=mode)
    after, auto = runs["after-norm"], runs["auto"]
    need = after[2].placement.host_bytes + after[2].placement.fixed_bytes
    assert auto[2].overlap == "backward" and auto[2].stats()["undo_bytes"] > 0
    _assert_bit_identical(after, auto)
    tight = ph.wrap(tiny_gpt(), window=2, clip_grad_norm=0.05, clip_mode="auto", host_memory_bytes=need + 4096)
    try:
        assert tight.overlap == "forward"
    finally:
        tight.close()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_step_with_inf_gradients_leaves_the_speculated_blocks_as_they_were(precision):
    """Blocks 2 and 3 get finite gradients and update speculatively; block 1 makes the rest inf.
    fp32 stops (DivergenceError), fp16 skips the step: either way every master is restored. (fp16
    starts at loss scale 4 so that blocks 2 and 3 do not overflow on their own.)"""
    model = _Stack()
    half = dict(precision="fp16", initial_loss_scale=4.0) if precision == "fp16" else {}
    engine = ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=1.0, clip_mode="speculative", **half)
    model.blocks[1].wait = lambda grad: grad * float("inf")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 32, generator=g), torch.randn(4, 1, generator=g)
    if half:
        x, y = x.half(), y.half()
    before = {n: p.clone() for n, p in engine.master_parameters().items()}
    try:
        engine.backward(engine(x, y))
        if half:
            engine.step()
            assert engine.skipped_steps == 1
        else:
            with pytest.raises(ph.DivergenceError):
                engine.step()
        engine.synchronize()
        for name, p in engine.master_parameters().items():
            torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    finally:
        engine.close()


def test_gradients_dropped_without_a_step_undo_the_speculative_updates():
    """backward then zero_grad() (no step): as after-norm, nothing is updated."""
    model = tiny_gpt()
    engine = ph.wrap(model, blocks=model.blocks, window=2, clip_grad_norm=1e3, clip_mode="speculative")
    x, y = gpt_batches(1)[0]
    before = {n: p.clone() for n, p in engine.master_parameters().items()}
    try:
        engine.backward(engine(x, y))
        engine.zero_grad()
        engine.synchronize()
        for name, p in engine.master_parameters().items():
            torch.testing.assert_close(p, before[name], rtol=0, atol=0, msg=name)
    finally:
        engine.close()
