"""Block discovery, and the clear refusals of pystronghold.wrap."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import pystronghold as ph
from pystronghold.models import GPT, GPTConfig
from runtime_models import (HetStack, assert_same_training, gpt_batches, het_batches,
                            one_torch_thread, run_both, tiny_gpt)

_threads = pytest.fixture(autouse=True)(one_torch_thread)


def test_import_pystronghold_stays_cheap():
    code = "import sys, pystronghold; assert 'torch' not in sys.modules, 'import pystronghold pulled in torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_blocks_are_found_when_omitted(caplog):
    model = tiny_gpt(layers=3)
    with caplog.at_level("INFO"):
        engine = ph.wrap(model, window=2)
    assert engine.n_blocks == 3 and "'blocks'" in caplog.text
    x, y = gpt_batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    engine.close()


def test_no_block_stack_is_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="pass blocks="):
        ph.wrap(model)


def test_ambiguous_block_stacks_are_refused():
    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = nn.Module(), nn.Module()
            self.encoder.layers = nn.ModuleList([nn.Linear(2, 2)])
            self.decoder.layers = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match="ambiguous"):
        ph.wrap(EncDec())


def test_wrapping_a_wrapped_model_is_refused_at_wrap():
    model = tiny_gpt(layers=3)
    engine = ph.wrap(model, window=2)
    try:
        for again in (lambda: ph.wrap(model, window=2), lambda: ph.wrap(model, blocks=model.blocks, window=3)):
            with pytest.raises(ValueError, match="^wrap: this GPT is already wrapped .*keep using that engine"):
                again()
        with pytest.raises(TypeError, match="^wrap: model is already an Engine"):
            ph.wrap(engine)
        x, y = gpt_batches(1)[0]  # the refusals left the first engine as it was
        engine.backward(engine(x, y))
        engine.step()
    finally:
        engine.close()
    ph.wrap(tiny_gpt(layers=3), window=2).close()  # another model of the same class is no wrapped one


def test_empty_block_list_is_refused():
    model = HetStack()
    model.blocks = nn.ModuleList()
    with pytest.raises(ValueError, match="empty"):
        ph.wrap(model, blocks=model.blocks)


@pytest.mark.parametrize("window", [0, -1, "two", 1.5, True])
def test_bad_window_is_an_error(window):
    model = HetStack()
    with pytest.raises(ValueError, match="window"):
        ph.wrap(model, blocks=model.blocks, window=window)


def test_window_larger_than_the_stack_is_clamped_with_a_warning():
    model = HetStack()
    with pytest.warns(UserWarning, match="using window=6"):
        engine = ph.wrap(model, blocks=model.blocks, window=50)
    assert engine.window_size == 6
    engine.close()


def test_weight_tied_between_a_block_and_the_tail_is_refused():
    model = HetStack()
    model.tail.weight = model.blocks[3].fc1.weight  # (8, 24) vs tail (3, 24): sharing is what counts
    with pytest.raises(ValueError, match="tied between a block and the head/tail"):
        ph.wrap(model, blocks=model.blocks)


def test_weight_shared_between_blocks_is_refused():
    model = HetStack()
    model.blocks[4].scale = model.blocks[1].scale
    with pytest.raises(ValueError, match="shared between blocks"):
        ph.wrap(model, blocks=model.blocks)


def test_embeddings_tied_between_head_and_tail_are_supported():
    def make():
        return GPT(GPTConfig(vocab_size=97, seq_len=32, layers=4, hidden=64, heads=4, tie_embeddings=True))

    ref, got = run_both(make, gpt_batches(8), window=2)
    assert_same_training(ref, got)


def test_host_memory_too_small_fails_before_allocating():
    model = HetStack()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MemoryError, match=r"needs [\d,]+ bytes .* but the host memory limit you set "
                       r"\(--host-memory / host_memory_bytes=\) is 100,000 bytes \(0.000 GiB\); the host has "
                       r"[\d,]+ bytes \([\d.]+ GiB\) available"):
        ph.wrap(model, blocks=model.blocks, host_memory_bytes=100_000)
    # nothing was touched: parameters still hold their values (no placeholders, no store)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_model_on_another_device_is_refused():
    with torch.device("meta"):
        model = HetStack()
    with pytest.raises(ValueError, match="is on meta, but device='cpu'"):
        ph.wrap(model, blocks=model.blocks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_backend_imports_and_refuses_clearly_without_cuda():
    import pystronghold.runtime.backends.backend_cuda  # noqa: F401  (importable without CUDA)

    model = HetStack()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ph.wrap(model, blocks=model.blocks, device="cuda")


def test_backward_overlap_with_clipping_is_refused():
    model = HetStack()
    with pytest.raises(ValueError, match="overlap='backward'"):
        ph.wrap(model, blocks=model.blocks, overlap="backward", clip_grad_norm=1.0)


def test_blocks_called_out_of_order_fail_loudly():
    model = HetStack()
    engine = ph.wrap(model, blocks=model.blocks, window=2)
    h = model.head(het_batches(1)[0][0])
    with pytest.raises(RuntimeError, match="out of the expected order"):
        model.blocks[1](h)
    engine.close()
