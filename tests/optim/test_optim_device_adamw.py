"""Which AdamW kernel ``DeviceAdamW`` runs (head, tail and resident blocks share the choice): torch's
fused kernel on CUDA, its single-tensor loop elsewhere, and the loop when torch lacks the kernel."""

from __future__ import annotations

import pytest
import torch

import pystronghold as ph
from pystronghold.optim import AdamW, DeviceAdamW
from pystronghold.optim.hyper import AdamWHyper
from pystronghold.optim.device_adamw import fused_adamw_for
from runtime_models import tiny_gpt


@pytest.mark.parametrize("device, fused", [("cuda", True), ("cuda:1", True), (torch.device("cuda", 0), True),
                                           ("cpu", False), (torch.device("cpu"), False), ("meta", False)])
def test_fused_on_cuda_only(device, fused):
    assert fused_adamw_for(device) is fused


def test_no_fused_kernel_in_this_torch_keeps_the_loop(monkeypatch):
    monkeypatch.delattr(torch, "_fused_adamw_")
    assert fused_adamw_for("cuda") is False


def test_the_choice_reaches_torch():
    p = torch.nn.Parameter(torch.randn(7))
    for fused in (False, True):
        opt = DeviceAdamW([p], AdamW(lr=1e-3), [p.detach()], fused=fused)
        torch_opt = opt._opts[0]
        assert torch_opt.defaults["fused"] is (True if fused else None) and torch_opt.defaults["foreach"] is False


def test_head_tail_and_resident_blocks_on_the_cpu_run_the_loop():
    engine = ph.wrap(tiny_gpt(), window=2, resident_blocks=1)
    try:
        assert engine.device_optimizer.fused is False and engine.resident.optimizer.fused is False
    finally:
        engine.close()


# ---- one block at a time

class _WholeModelAdamW:
    """The update ``DeviceAdamW`` made before it went block by block, kept as the reference: one
    torch AdamW over every master, every fp32 gradient made (cast, then scaled) before it runs."""

    def __init__(self, params, spec, masters, groups):
        self.params = params
        half = any(p.dtype != torch.float32 for p in params)
        self.masters = [m.detach().clone().requires_grad_(True) for m in masters] if half else params
        self.ids = sorted(set(groups))
        self.opt = torch.optim.AdamW([{"params": [m for m, g in zip(self.masters, groups) if g == gid]}
                                      for gid in self.ids], lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                     weight_decay=spec.weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, hyper):
        for group, gid in zip(self.opt.param_groups, self.ids):
            h = hyper[gid]
            group.update(lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay)
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            if m is not p:
                m.grad = p.grad.float()
            if hyper[0].grad_scale != 1.0:
                m.grad.mul_(hyper[0].grad_scale)
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)


BLOCKS = [3, 1, 2]  # parameters per block
SHAPES = [(17,), (7, 3), (1,), (33,), (5, 5), (1023,)]


def _params(dtype):
    g = torch.Generator().manual_seed(7)
    masters = [torch.randn(s, generator=g) for s in SHAPES]
    return [torch.nn.Parameter(m.to(dtype)) for m in masters], masters


def _hyper(step, grad_scale):
    # two param groups: group 1 another lr and no weight decay
    return [AdamWHyper(step=step, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, grad_scale=grad_scale),
            AdamWHyper(step=step, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, grad_scale=grad_scale)]


@pytest.mark.parametrize("dtype, grad_scale", [(torch.float32, 1.0), (torch.float32, 0.37),
                                               (torch.bfloat16, 0.5), (torch.float16, 1 / 1024 * 0.61)],
                         ids=["fp32", "fp32-clip", "bf16-clip", "fp16-loss-scale-clip"])
def test_block_by_block_is_the_whole_model_update_bit_for_bit(dtype, grad_scale):
    groups = [0, 1, 0, 1, 1, 0]
    spec = AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    params, masters = _params(dtype)
    ref_params, _ = _params(dtype)
    opt = DeviceAdamW(params, spec, masters, groups, blocks=BLOCKS)
    ref = _WholeModelAdamW(ref_params, spec, masters, groups)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 5):
        for k, (p, q) in enumerate(zip(params, ref_params)):
            # fp16: gradients of a scaled loss (1024); a parameter without a gradient at step 2
            grad = None if (step == 2 and k == 3) else (torch.randn(p.shape, generator=g) * 1024).to(dtype)
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        opt.step(_hyper(step, grad_scale))
        ref.step(_hyper(step, grad_scale))
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert torch.equal(p, q) and torch.equal(opt.masters[i], ref.masters[i]), (step, i)
            mine, want = opt.state_of(i), ref.opt.state.get(ref.masters[i], {})
            assert set(mine) == set(want) and all(torch.equal(mine[k], want[k]) for k in want), (step, i)


def test_a_resident_blocks_fp32_gradients_live_only_during_its_own_update():
    """bf16, three resident blocks: at every torch AdamW step (a global optimizer hook, seen from
    outside) the fp32 gradients alive are those of one block, never the three blocks' at once."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen: list[tuple[int, int]] = []  # (fp32 gradient bytes alive in the engine's masters, of one block)

    def hook(optimizer, args, kwargs):
        if any(p is m for m in masters for p in optimizer.param_groups[0]["params"]):
            alive = sum(m.grad.nbytes for m in masters if m.grad is not None and m.grad.dtype == torch.float32)
            mine = sum(p.numel() * 4 for g in optimizer.param_groups for p in g["params"])
            seen.append((alive, mine))

    model = tiny_gpt()
    engine = ph.wrap(model, window=2, resident_blocks=3, precision="bf16", clip_grad_norm=1.0)
    masters = engine.resident.optimizer.masters
    handle = register_optimizer_step_pre_hook(hook)
    try:
        x = torch.randint(0, 97, (2, 32))
        engine.backward(engine(x, x))
        engine.step()
    finally:
        handle.remove()
        engine.close()
    block_bytes = [sum(m.numel() * 4 for m in masters[r.start:r.stop]) for r in engine.resident.optimizer.blocks]
    assert len(seen) == 3 and sorted(mine for _, mine in seen) == sorted(block_bytes)
    assert all(alive == mine for alive, mine in seen), seen
    assert all(m.grad is None for m in masters)


@pytest.mark.parametrize("blocks", [[1], [3, 1], [-1, 3]])
def test_blocks_that_do_not_cover_the_parameters_are_refused(blocks):
    params, masters = _params(torch.float32)
    with pytest.raises(ValueError, match="blocks=.* summing to the 2 parameters"):
        DeviceAdamW(params[:2], AdamW(), masters[:2], blocks=blocks)
