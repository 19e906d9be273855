"""Every bad input of the fused Adam gets a ValueError that names the argument and the expectation."""

import pytest
import torch

from pystronghold.optim import CPUAdam
from pystronghold.optim.functional import adam_step_, grad_sq_norm

N = 100
HP = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


def good():
    return dict(param=torch.randn(N), grad=torch.randn(N), exp_avg=torch.zeros(N), exp_avg_sq=torch.zeros(N))


def call(**over):
    bufs = good()
    hp = dict(HP)
    for k, v in over.items():
        (bufs if k in bufs else hp)[k] = v
    shadow = hp.pop("shadow", None)
    return adam_step_(bufs["param"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], shadow=shadow, **hp)


BIG = torch.zeros(4 * N)


@pytest.mark.parametrize("over,pattern", [
    (dict(param=torch.randn(N, dtype=torch.float64)), r"param must be float32, got Double"),
    (dict(param=torch.randn(N).to(torch.bfloat16)), r"param must be float32"),
    (dict(grad=torch.ones(N, dtype=torch.int32)), r"grad must be float32, bfloat16 or float16, got Int"),
    (dict(exp_avg=torch.zeros(N, dtype=torch.float16)), r"exp_avg must be float32"),
    (dict(exp_avg_sq=torch.zeros(N, dtype=torch.float64)), r"exp_avg_sq must be float32"),
    (dict(shadow=torch.zeros(N)), r"shadow must be bfloat16 or float16, got Float"),
    (dict(param=torch.randn(2 * N)[::2]), r"param must be contiguous"),
    (dict(grad=torch.randn(N, 2).t()[0]), r"grad must be contiguous"),
    (dict(exp_avg_sq=torch.zeros(2 * N)[::2]), r"exp_avg_sq must be contiguous"),
    (dict(grad=torch.randn(N + 1)), r"grad must have the same number of elements as param \(100\), got 101"),
    (dict(exp_avg=torch.zeros(N - 1)), r"exp_avg must have the same number of elements"),
    (dict(exp_avg_sq=torch.zeros(7)), r"exp_avg_sq must have the same number of elements"),
    (dict(shadow=torch.zeros(3, dtype=torch.bfloat16)), r"shadow must have the same number of elements"),
    (dict(param=torch.randn(N, device="meta")), r"param must be on the CPU, got device meta"),
    (dict(grad=torch.randn(N, device="meta")), r"grad must be on the CPU"),
    (dict(param=torch.randn(N, dtype=torch.complex64)), r"param must be real"),
    (dict(param=torch.randn(N).to_sparse()), r"param must be a dense"),
    (dict(exp_avg=BIG[:N], exp_avg_sq=BIG[N // 2: N // 2 + N]), r"exp_avg and exp_avg_sq overlap"),
    (dict(param=BIG[:N], shadow=BIG[:N // 2].view(torch.bfloat16)), r"param and shadow overlap"),
    (dict(step=0), r"step must be >= 1"),
    (dict(step=2.0), r"step must be an int"),
    (dict(lr=-1.0), r"lr must be >= 0"),
    (dict(beta1=1.0), r"beta1 must be in \[0, 1\)"),
    (dict(beta2=-0.1), r"beta2 must be in \[0, 1\)"),
    (dict(eps=-1e-8), r"eps must be >= 0"),
    (dict(weight_decay=-0.1), r"weight_decay must be >= 0"),
    (dict(grad_scale=float("inf")), r"grad_scale must be finite"),
])
def test_adam_step_bad_inputs(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(**over)


def test_same_tensor_twice_is_rejected():
    p = torch.randn(N)
    with pytest.raises(ValueError, match="param and grad overlap"):
        adam_step_(p, p, torch.zeros(N), torch.zeros(N), **HP)


def test_good_call_passes():
    assert call() is True  # the fixture above is valid: every failure comes from the one bad field


@pytest.mark.parametrize("grad,kw,pattern", [
    (torch.ones(4, dtype=torch.int64), {}, r"grad must be float32, bfloat16 or float16"),
    (torch.ones(8)[::2], {}, r"grad must be contiguous"),
    (torch.ones(4, device="meta"), {}, r"grad must be on the CPU"),
    (torch.ones(4), {"grad_scale": float("nan")}, r"grad_scale must be finite"),
])
def test_grad_sq_norm_bad_inputs(grad, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        grad_sq_norm(grad, **kw)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(amsgrad=True), r"does not support amsgrad=True"),
    (dict(maximize=True), r"does not support maximize=True"),
    (dict(capturable=True), r"does not support capturable=True"),
    (dict(differentiable=True), r"does not support differentiable=True"),
    (dict(foreach=True), r"does not support foreach=True"),
    (dict(fused=True), r"does not support fused=True"),
    (dict(lr=-1.0), r"lr must be >= 0"),
    (dict(betas=(1.0, 0.999)), r"betas\[0\] must be in"),
    (dict(betas=(0.9, 1.5)), r"betas\[1\] must be in"),
    (dict(eps=-1.0), r"eps must be >= 0"),
    (dict(weight_decay=-1.0), r"weight_decay must be >= 0"),
])
def test_cpu_adam_bad_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        CPUAdam([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_cpu_adam_bad_params():
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        CPUAdam([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    opt = CPUAdam([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="does not support amsgrad=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "amsgrad": True})
    opt.param_groups[0]["maximize"] = True  # edited after construction: caught at step()
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="does not support maximize=True"):
        opt.step()
