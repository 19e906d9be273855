"""Tensors that leave a block by a side channel (a forward hook on a submodule keeps its output, as
transformers does for MoE router logits and attention weights) train as in plain PyTorch: they are
carried out of the block's autograd Function and recomputed in backward (runtime/blocks/side_outputs.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pystronghold as ph
from runtime_models import (HYPER, MLPBlock, assert_same_training, het_batches, one_torch_thread, run_both,
                            train_engine, train_reference)

_threads = pytest.fixture(autouse=True)(one_torch_thread)

STEPS = 4


# ---- a model whose loss uses what a hook collects inside its blocks


class SplitBlock(nn.Module):
    """Its ``split`` submodule returns a view (B, T, 2, d/2) of the projection's output; a lazily
    made mask is kept as an attribute of ``scale`` (block state, returned by it as it is)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj, self.split, self.scale = nn.Linear(d, d), nn.Unflatten(-1, (2, d // 2)), MaskOnce()

    def forward(self, x):
        h = self.split(self.proj(x))
        return x + torch.tanh(h.flatten(-2)) * self.scale(x)


class MaskOnce(nn.Module):
    def forward(self, x):
        if getattr(self, "mask", None) is None:
            self.mask = torch.linspace(0.5, 1.5, x.shape[-1])
        return self.mask


class CollectingStack(nn.Module):
    """head -> blocks -> tail; a forward hook on a layer of each block collects that layer's output,
    and the loss adds a penalty on what was collected (as an MoE router loss does)."""

    def __init__(self, d: int = 8, split: bool = False) -> None:
        super().__init__()
        self.head, self.tail = nn.Linear(10, d), nn.Linear(d, 3)
        self.blocks = nn.ModuleList([SplitBlock(d) if split else MLPBlock(d, 16) for _ in range(3)])
        self.collected: list[torch.Tensor] = []
        for block in self.blocks:  # a bound method: deepcopy rebinds it
            (block.split if split else block.fc1).register_forward_hook(self.collect)

    def collect(self, module, args, output) -> None:
        self.collected.append(output)

    def forward(self, x, y):
        self.collected = []
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        penalty = sum(t.square().mean() for t in self.collected)
        return F.mse_loss(self.tail(h), y) + 0.5 * penalty


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("window", [1, 2])
def test_a_hooked_submodule_output_used_by_the_loss_trains_to_plain_pytorch(window, checkpointing):
    ref, got = run_both(CollectingStack, het_batches(STEPS), window=window, checkpointing=checkpointing,
                        strict=True)
    assert_same_training(ref, got)  # measured: bit for bit on this CPU


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_hooked_view_trains_and_block_state_stays_out_of_the_graph(checkpointing):
    ref, got = run_both(lambda: CollectingStack(split=True), het_batches(STEPS), window=2,
                        checkpointing=checkpointing, strict=True)
    assert_same_training(ref, got)
    model = got[2].model
    assert all(not block.scale.mask.requires_grad for block in model.blocks)


class MeanKeepingStack(CollectingStack):
    """The hook keeps a tensor it makes itself (no submodule returns it): it cannot be carried."""

    def collect(self, module, args, output) -> None:
        self.collected.append(output.mean())


def test_strict_mode_names_a_tensor_that_escapes_a_block_and_cannot_be_carried():
    engine = ph.wrap(MeanKeepingStack(), window=2, strict=True)
    x, y = het_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"^strict: block 0 lets a tensor it made escape \(\(\) float32, "
                                           r"from [\w.]*mean\)[^\n]*$"):
        engine(x, y)
    engine.close()


class FirstRunOnlyBlock(nn.Module):
    """Calls ``extra`` in its first run only (hidden state): its recompute calls ``lin`` elsewhere."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.extra, self.lin = nn.Linear(d, d), nn.Linear(d, d)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        if self.runs == 1:
            x = x + self.extra(x)
        return x + self.lin(x)


def test_a_recompute_that_loses_a_side_output_is_one_line_error():
    model = CollectingStack()
    model.blocks[0] = FirstRunOnlyBlock(8)
    model.blocks[0].lin.register_forward_hook(model.collect)
    engine = ph.wrap(model, window=2)
    x, y = het_batches(1)[0]
    loss = engine(x, y)
    with pytest.raises(RuntimeError, match=r"^block 0's recompute gave nothing where its forward gave side output "
                                           r"0 \(output 0 of its Linear, \(4, 5, 8\) float32\)[^\n]*$"):
        engine.backward(loss)
    engine.close()


# ---- Hugging Face MoE models: the router logits


transformers = pytest.importorskip("transformers")
from hf_small import MOE_MODELS, hf_llama, token_batches  # noqa: E402


def lm_loss(model, x):
    """The causal-LM loss of one batch, with the router load-balancing loss the config turns on."""
    return model(input_ids=x, labels=x).loss


@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
def test_moe_models_with_the_router_loss_train_to_plain_pytorch_losses(kind):
    model = MOE_MODELS[kind]()
    batches = token_batches(STEPS)
    ref = train_reference(copy.deepcopy(model), batches, loss_of=lm_loss)
    for window in (1, 2):
        for checkpointing in (True, False):
            engine = ph.wrap(copy.deepcopy(model), window=window, checkpointing=checkpointing)
            x = batches[0]
            out = engine(input_ids=x, labels=x)
            assert len(out.router_logits) == 2 and all(r.requires_grad for r in out.router_logits)
            assert out.aux_loss.requires_grad
            engine.close()
            got = train_engine(copy.deepcopy(model), batches, loss_of=lm_loss, blocks=None, window=window,
                               checkpointing=checkpointing, strict=True)
            assert_same_training(ref, got)  # measured: bit for bit on this CPU


@pytest.mark.parametrize("checkpointing", [True, False])
def test_moe_router_loss_through_the_relay_schedule_equals_plain_pytorch(checkpointing):
    model = MOE_MODELS["mixtral"]()
    m = 2
    batches = token_batches(STEPS * m)
    ref = train_reference(copy.deepcopy(model), batches, accumulation=m, loss_of=lm_loss)
    engine = ph.wrap(model, optimizer=ph.AdamW(**HYPER, bitwise_torch=True), window=2, accumulation_steps=m,
                     schedule="relay", checkpointing=checkpointing, strict=True)
    try:
        losses = []
        for s in range(STEPS):
            losses += engine.accumulate(batches[s * m:(s + 1) * m], lambda x: lm_loss(engine, x), mean=False).tolist()
            engine.step()
            engine.zero_grad()
        params = {k: v.clone() for k, v in engine.master_parameters().items()}
    finally:
        engine.close()
    assert_same_training(ref, (losses, params, engine))


def test_attention_weights_used_by_the_loss_train_to_plain_pytorch():
    """``output_attentions=True`` (eager attention): the weights leave each block by a hook too."""
    model = hf_llama()
    model.set_attn_implementation("eager")

    def loss_with_attentions(m, x):
        out = m(input_ids=x, labels=x, output_attentions=True)
        return out.loss + sum(a.square().mean() for a in out.attentions)

    batches = token_batches(STEPS)
    ref = train_reference(copy.deepcopy(model), batches, loss_of=loss_with_attentions)
    got = train_engine(model, batches, loss_of=loss_with_attentions, blocks=None, window=2, strict=True)
    assert_same_training(ref, got)
