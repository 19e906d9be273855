"""Frozen parameters on the CUDA backend: the copy-outs cut to a block's trainable part, wholly
frozen blocks (no gradient buffer, no copy-out) and frozen head, tail and resident parameters kept
in the compute dtype outside the device AdamW. The CPU tests hold all of this to plain PyTorch; on
CUDA the copies run on their own streams, so W=1/2 are compared with W=all bit for bit (strict
mode poisons released slots) and the resident blocks' device AdamW with plain PyTorch's fused one.
"""

import copy

import pytest
import torch

import pystronghold as ph
from runtime_models import HYPER, gpt_batches, tiny_gpt, train_engine

STEPS = 6
LAYERS = 4


def frozen_gpt(pattern: str):
    """A tiny GPT with ``mixed`` (every block's qkv weight and first LayerNorm) or ``partial``
    (the token embedding and the first half of the blocks) parameters frozen."""
    torch.manual_seed(0)
    model = tiny_gpt(LAYERS)
    for name, p in model.named_parameters():
        block = int(name.split(".")[1]) if name.startswith("blocks.") else None
        if pattern == "mixed":
            freeze = block is not None and ("attn.qkv.weight" in name or ".ln1." in name)
        else:
            freeze = name == "head.tok.weight" or (block is not None and block < LAYERS // 2)
        p.requires_grad_(not freeze)
    return model


def train(pattern: str, batches, **options):
    torch.manual_seed(1234)
    losses, params, _ = train_engine(frozen_gpt(pattern), [(x.cuda(), y.cuda()) for x, y in batches],
                                     device="cuda", **options)
    return losses, params


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("pattern", ["mixed", "partial"])
@pytest.mark.parametrize("window", [1, 2])
def test_cuda_frozen_parameters_window_is_exact_against_w_all(cuda_build, pattern, window, precision):
    """With clipping (norms over the trainable parameters only) and strict mode."""
    batches = gpt_batches(STEPS)
    ref_losses, ref_params = train(pattern, batches, window="all", precision=precision, clip_grad_norm=0.5)
    losses, params = train(pattern, batches, window=window, precision=precision, clip_grad_norm=0.5, strict=True)
    what = f"{pattern} W={window} {precision}"
    assert losses == ref_losses, f"{what}: {losses} != {ref_losses}"
    for name, p in ref_params.items():
        assert torch.equal(params[name], p), f"{what}: {name} differs"
    for name, p in frozen_gpt(pattern).named_parameters():
        if not p.requires_grad:  # frozen: the value it started with (rounded to the compute dtype)
            want = p.detach().to(torch.bfloat16 if precision == "bf16" else torch.float32).float()
            assert torch.equal(params[name].cpu(), want), f"{what}: frozen {name} moved"


@pytest.mark.parametrize("pattern", ["mixed", "partial"])
def test_cuda_resident_blocks_with_frozen_parameters_match_fused_adamw(cuda_build, pattern):
    """K=N resident blocks (device AdamW) with frozen parameters against plain PyTorch + fused AdamW
    over the trainable parameters (separate optimizers over fp32 masters, hence a tolerance)."""
    model, batches = frozen_gpt(pattern), [(x.cuda(), y.cuda()) for x, y in gpt_batches(STEPS)]
    plain = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], **HYPER, fused=True)
    want = []
    for x, y in batches:
        loss = plain(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    engine = ph.wrap(model, window="all", resident_blocks=LAYERS, device="cuda", optimizer=ph.AdamW(**HYPER))
    try:
        got = []
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
            got.append(loss.item())
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
        masters = engine.master_parameters()
        for name, p in plain.named_parameters():
            torch.testing.assert_close(masters[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    finally:
        engine.close()
