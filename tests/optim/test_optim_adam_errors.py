"""Every bad input of the fused Adam gets a ValueError that names the argument and the expectation."""

import pytest
import torch

from pystronghold.ops import native_ops
from pystronghold.optim import AdamWHyper, CPUAdam
from pystronghold.optim.functional import adam_step_, grad_sq_norm

N = 100
HP = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def good():
    return dict(param=torch.randn(N), grad=torch.randn(N), exp_avg=torch.zeros(N), exp_avg_sq=torch.zeros(N))


def call(**over):
    bufs = good()
    hp = dict(HP)
    for k, v in over.items():
        (bufs if k in bufs else hp)[k] = v
    shadow = hp.pop("shadow", None)
    return adam_step_(bufs["param"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], AdamWHyper(**hp),
                      shadow=shadow)


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
])
def test_adam_step_bad_inputs(over, pattern):
    with pytest.raises(ValueError, match=pattern):
        call(**over)


@pytest.mark.parametrize("over,error,pattern", [
    (dict(step=0), ValueError, r"AdamWHyper.step must be >= 1"),
    (dict(step=2.0), TypeError, r"AdamWHyper.step must be an int, got float"),
    (dict(step=True), TypeError, r"AdamWHyper.step must be an int, got bool"),
    (dict(lr=-1.0), ValueError, r"AdamWHyper.lr must be >= 0"),
    (dict(lr="big"), TypeError, r"AdamWHyper.lr must be a number, got str"),
    (dict(lr=torch.ones(2)), ValueError, r"AdamWHyper.lr must be a number or a 1-element tensor"),
    (dict(betas=(1.0, 0.999)), ValueError, r"AdamWHyper.betas\[0\] must be in \[0, 1\)"),
    (dict(betas=(0.9, -0.1)), ValueError, r"AdamWHyper.betas\[1\] must be in \[0, 1\)"),
    (dict(betas=(0.9,)), ValueError, r"AdamWHyper.betas must be two values"),
    (dict(eps=-1e-8), ValueError, r"AdamWHyper.eps must be >= 0"),
    (dict(weight_decay=-0.1), ValueError, r"AdamWHyper.weight_decay must be >= 0"),
    (dict(grad_scale=float("inf")), ValueError, r"AdamWHyper.grad_scale must be finite"),
])
def test_hyper_bad_values(over, error, pattern):
    with pytest.raises(error, match=pattern):
        AdamWHyper(**{**HP, **over})


def test_hyper_is_frozen_and_takes_a_tensor_lr():
    hyper = AdamWHyper(**{**HP, "lr": torch.tensor(2e-3)})
    assert hyper.lr == pytest.approx(2e-3) and type(hyper.lr) is float
    with pytest.raises(AttributeError):
        hyper.lr = 1.0
    with pytest.raises(TypeError, match="hyper must be a pystronghold.optim.AdamWHyper, got dict"):
        adam_step_(*good().values(), HP)


# The operator itself (torch.ops.pystronghold.adam_step, which AdamWHyper's checks do not guard when
# called directly) checks the values too; arguments: step, lr, beta1, beta2, eps, weight_decay, adamw,
# grad_scale, check_finite, bitwise_torch.
OP_ARGS = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, grad_scale=1.0,
               check_finite=True, bitwise_torch=False)


@pytest.mark.parametrize("over,pattern", [
    (dict(step=0), r"adam_step: step must be >= 1"),
    (dict(lr=-1.0), r"adam_step: lr must be >= 0"),
    (dict(beta1=1.0), r"adam_step: beta1 must be in \[0, 1\)"),
    (dict(beta2=-0.1), r"adam_step: beta2 must be in \[0, 1\)"),
    (dict(eps=-1e-8), r"adam_step: eps must be >= 0"),
    (dict(weight_decay=-0.1), r"adam_step: weight_decay must be >= 0"),
    (dict(grad_scale=float("inf")), r"adam_step: grad_scale must be finite"),
])
def test_operator_bad_values(over, pattern):
    bufs = good()
    with pytest.raises(ValueError, match=pattern):
        native_ops().adam_step(*bufs.values(), None, *{**OP_ARGS, **over}.values())


def test_same_tensor_twice_is_rejected():
    p = torch.randn(N)
    with pytest.raises(ValueError, match="param and grad overlap"):
        adam_step_(p, p, torch.zeros(N), torch.zeros(N), AdamWHyper(**HP))


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
