"""Warm-up + cosine schedule against values worked out by hand; state_dict round trip."""

import math

import pytest
import torch

from pystronghold.lr_schedule import WarmupCosine, warmup_cosine


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def _lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_hand_computed_values():
    opt = _opt(0.6)
    sched = warmup_cosine(opt, warmup_steps=3, decay_steps=7, min_ratio=0.1)
    got = _lrs(sched, opt, 9)
    # warm-up 0.2, 0.4, 0.6; cosine over 4 steps: progress 0, 1/4, 2/4, 3/4; then the floor 0.06
    c = lambda p: 0.6 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))  # noqa: E731
    expected = [0.2, 0.4, 0.6, c(0), c(0.25), c(0.5), c(0.75), 0.06, 0.06]
    assert got == pytest.approx(expected)
    assert expected[4] == pytest.approx(0.6 * (0.1 + 0.45 * (1 + math.sqrt(0.5))))


def test_no_warmup_starts_at_peak_and_reaches_zero_floor():
    s = WarmupCosine(warmup_steps=0, decay_steps=4, min_ratio=0.0)
    assert [s(k) for k in range(6)] == pytest.approx([1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 0, 0])


def test_state_dict_round_trip_resumes_the_schedule():
    opt = _opt(1.0)
    sched = warmup_cosine(opt, warmup_steps=5, decay_steps=50)
    reference = _lrs(sched, opt, 30)
    opt2 = _opt(1.0)
    sched2 = warmup_cosine(opt2, warmup_steps=5, decay_steps=50)
    _lrs(sched2, opt2, 12)
    state, opt_state = sched2.state_dict(), opt2.state_dict()
    assert state["lr_lambdas"][0] == {"warmup_steps": 5, "decay_steps": 50, "min_ratio": 0.1}
    opt3 = _opt(1.0)
    sched3 = warmup_cosine(opt3, warmup_steps=5, decay_steps=50)
    opt3.load_state_dict(opt_state)
    sched3.load_state_dict(state)
    assert _lrs(sched3, opt3, 18) == pytest.approx(reference[12:])


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="decay_steps"):
        WarmupCosine(warmup_steps=10, decay_steps=5)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(warmup_steps=-1, decay_steps=5)
    with pytest.raises(ValueError, match="min_ratio"):
        WarmupCosine(decay_steps=5, min_ratio=1.5)
