"""`adam_step_multi_`: many tensors in one parallel region give exactly one `adam_step_` per tensor."""

import pytest
import torch

from pystronghold.optim import AdamWHyper
from pystronghold.optim.functional import adam_step_, adam_step_multi_

# Sizes hit the SIMD tails and make thread ranges cross tensor boundaries (the total exceeds the
# single-thread threshold, so two threads split it somewhere inside a tensor).
SIZES = [1, 7, 17, 1023, 0, 2**16 + 5, 3, 2**15 - 1]
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


def make_sets(grad_dtype, shadow_dtype):
    sets = []
    for n in SIZES:
        sets.append(dict(p=torch.randn(n), g=torch.randn(n).to(grad_dtype), m=torch.randn(n), v=torch.rand(n),
                         sh=None if shadow_dtype is None else torch.empty(n, dtype=shadow_dtype)))
    return sets


def clone_sets(sets):
    return [{k: (None if t is None else t.clone()) for k, t in s.items()} for s in sets]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shadow_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("adamw,wd", [(True, 0.1), (False, 0.1), (True, 0.0)])
@pytest.mark.parametrize("bitwise_torch", [False, True])
def test_multi_equals_one_call_per_tensor(grad_dtype, shadow_dtype, adamw, wd, bitwise_torch):
    one = make_sets(grad_dtype, shadow_dtype)
    multi = clone_sets(one)
    for step in (1, 2, 3):
        hyper = AdamWHyper(step=step, weight_decay=wd, adamw=adamw, grad_scale=0.5, **HP)
        for s in one:
            assert adam_step_(s["p"], s["g"], s["m"], s["v"], hyper, shadow=s["sh"], bitwise_torch=bitwise_torch)
        assert adam_step_multi_([s["p"] for s in multi], [s["g"] for s in multi], [s["m"] for s in multi],
                                [s["v"] for s in multi], hyper, bitwise_torch=bitwise_torch,
                                shadows=None if shadow_dtype is None else [s["sh"] for s in multi])
    for a, b in zip(one, multi):
        for k in ("p", "m", "v", "sh"):
            if a[k] is not None:
                assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("where", [0, 3, 5, 7])
def test_multi_overflow_in_one_tensor_skips_all(where):
    sets = make_sets(torch.float32, torch.bfloat16)
    sets[where]["g"][-1] = float("nan")
    before = clone_sets(sets)
    applied = adam_step_multi_([s["p"] for s in sets], [s["g"] for s in sets], [s["m"] for s in sets],
                               [s["v"] for s in sets], AdamWHyper(step=1, weight_decay=0.0, **HP),
                               shadows=[s["sh"] for s in sets])
    assert applied is False
    for a, b in zip(sets, before):
        for k in ("p", "m", "v", "sh"):
            assert torch.equal(a[k].view(torch.int16) if k == "sh" else a[k],
                               b[k].view(torch.int16) if k == "sh" else b[k]), k


def test_multi_empty_list_is_a_no_op():
    assert adam_step_multi_([], [], [], [], AdamWHyper(step=1, weight_decay=0.0, **HP)) is True


def _bufs(n=10, count=3):
    return [[torch.randn(n) for _ in range(count)] for _ in range(4)]


@pytest.mark.parametrize("mutate,pattern", [
    (lambda b: b[1].pop(), r"params, grads, exp_avgs and exp_avg_sqs must have the same length, got 3, 2"),
    (lambda b: b[1].__setitem__(2, torch.randn(10).to(torch.bfloat16)),
     r"grads\[2\] must have the dtype of grads\[0\] \(Float\), got BFloat16"),
    (lambda b: b[2].__setitem__(1, torch.zeros(10, dtype=torch.float64)), r"exp_avgs\[1\] must be float32"),
    (lambda b: b[3].__setitem__(2, torch.zeros(9)), r"exp_avg_sqs\[2\] must have the same number of elements"),
    (lambda b: b[0].__setitem__(2, b[0][0]), r"params\[0\] and params\[2\] overlap in memory"),
    (lambda b: b[2].__setitem__(0, b[1][1]), r"grads\[1\] and exp_avgs\[0\] overlap|exp_avgs\[0\] and grads\[1\] overlap"),
])
def test_multi_bad_inputs(mutate, pattern):
    bufs = _bufs()
    mutate(bufs)
    with pytest.raises(ValueError, match=pattern):
        adam_step_multi_(*bufs, AdamWHyper(step=1, weight_decay=0.0, **HP))


def test_multi_bad_shadows():
    bufs = _bufs()
    with pytest.raises(ValueError, match=r"shadows must be None or have one tensor per param \(3\), got 1"):
        adam_step_multi_(*bufs, AdamWHyper(step=1, weight_decay=0.0, **HP),
                         shadows=[torch.zeros(10, dtype=torch.bfloat16)])
    shadows = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.float16),
               torch.zeros(10, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"shadows\[1\] must have the dtype of shadows\[0\]"):
        adam_step_multi_(*bufs, AdamWHyper(step=1, weight_decay=0.0, **HP), shadows=shadows)
    with pytest.raises(TypeError, match=r"AdamWHyper.step must be an int"):
        adam_step_multi_(*bufs, AdamWHyper(step=1.0, weight_decay=0.0, **HP))
