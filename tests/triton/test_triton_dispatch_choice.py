"""Dispatch between the Triton kernels and torch's paths: the env override, the shape-class cache, the
injected timer, the agreement across ranks, and that both paths give the same numbers.

On CPU the dispatcher never measures by default; these tests install a `Dispatcher` that measures on
DEVICE with a fake timer (it says which path is faster; nothing is timed) and run the Triton paths in
the interpreter (PYSTRONGHOLD_TRITON_ON_CPU=1) on CPU, compiled on CUDA tensors when a GPU is present.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel imports (kernels/_config.py)

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.kernels import reference  # noqa: E402
from pystronghold.models import GPT, GPTConfig  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402

# a GPU machine compiles the kernels (they refuse CPU tensors): the tests that run Triton use CUDA tensors there
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

class FakeTimer:
    """Says `seconds[op][path]` (default: triton 1, torch 2) and records every call."""

    def __init__(self, seconds=None):
        self.seconds, self.calls = seconds or {}, []

    def __call__(self, op, path, run):
        self.calls.append((op, path))
        return self.seconds.get(op, {"triton": 1.0, "torch": 2.0})[path]


@pytest.fixture
def fake(monkeypatch):
    """A dispatcher measuring on DEVICE with a FakeTimer; Triton available on CPU; no override."""
    timer = FakeTimer()
    monkeypatch.setattr(dispatch, "DISPATCHER", dispatch.Dispatcher(timer=timer, measured_devices=(DEVICE,)))
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return timer


@pytest.fixture
def spies(monkeypatch):
    """Counts the calls that reach the Triton layer_norm and the torch reference layer_norm."""
    from pystronghold.kernels import norms

    counts = {"triton": 0, "torch": 0}
    for module, name, path in ((norms, "layer_norm", "triton"), (reference, "layer_norm_reference", "torch")):
        real = getattr(module, name)

        def spy(*args, _real=real, _path=path, **kwargs):
            counts[_path] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts


# ---- the environment variable


def test_parse_modes_defaults_and_per_op_entries():
    assert set(dispatch.parse_modes("").values()) == {"auto"}
    assert set(dispatch.parse_modes("torch").values()) == {"torch"}
    modes = dispatch.parse_modes(" attention:triton , torch ")
    assert modes["attention"] == "triton" and modes["layer_norm"] == "torch"
    modes = dispatch.parse_modes("rms_norm:torch")
    assert modes["rms_norm"] == "torch" and modes["attention"] == "auto"
    assert set(modes) == set(dispatch.OPS)


@pytest.mark.parametrize("value,match", [
    ("fast", "mode 'fast'"), ("attention:fast", "mode 'fast'"), ("atention:torch", "unknown op 'atention'"),
    ("torch,triton", "more than one default"), ("attention:torch,attention:triton", "given twice"),
    ("triton,", "mode ''"),
])
def test_bad_values_are_one_line_errors_naming_the_variable(value, match, monkeypatch):
    with pytest.raises(ValueError, match=match) as info:
        dispatch.parse_modes(value)
    assert str(info.value).startswith(f"{dispatch.ENV}=") and "\n" not in str(info.value)
    monkeypatch.setenv(dispatch.ENV, value)  # validated at every call, on CPU tensors too
    with pytest.raises(ValueError, match=dispatch.ENV):
        PF.layer_norm(torch.randn(2, 8), torch.ones(8))


# ---- CPU keeps today's behaviour


@pytest.mark.parametrize("mode", ["", "auto", "triton", "layer_norm:triton"])
def test_cpu_tensors_take_the_reference_without_the_interpreter_switch(mode, monkeypatch, spies):
    timer = FakeTimer()
    monkeypatch.setattr(dispatch, "DISPATCHER", dispatch.Dispatcher(timer=timer))  # measures CUDA only
    monkeypatch.delenv(PF.FORCE_ENV, raising=False)
    monkeypatch.setenv(dispatch.ENV, mode)
    x, w, b = torch.randn(5, 24), torch.randn(24), torch.randn(24)
    torch.testing.assert_close(PF.layer_norm(x, w, b), F.layer_norm(x, (24,), w, b), rtol=0, atol=0)
    assert spies == {"triton": 0, "torch": 1} and timer.calls == []


def test_interpreter_switch_means_triton_unless_overridden(monkeypatch, spies):
    """Mode auto on a device the dispatcher does not measure is Triton: CPU tensors with the interpreter switch
    (the default dispatcher measures CUDA only); on a GPU machine, CUDA tensors and a dispatcher measuring CPU."""
    other = ("cuda",) if DEVICE == "cpu" else ("cpu",)
    monkeypatch.setattr(dispatch, "DISPATCHER", dispatch.Dispatcher(timer=FakeTimer(), measured_devices=other))
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    x, w = torch.randn(5, 24, device=DEVICE), torch.randn(24, device=DEVICE)
    monkeypatch.setenv(dispatch.ENV, "auto")
    PF.layer_norm(x, w)
    assert spies == {"triton": 1, "torch": 0} and dispatch.DISPATCHER.choices() == {}
    monkeypatch.setenv(dispatch.ENV, "triton,layer_norm:torch")
    PF.layer_norm(x, w)
    assert spies == {"triton": 1, "torch": 1}


# ---- measured once per shape class


def test_choice_is_measured_once_per_shape_class(fake, spies):
    fake.seconds["layer_norm"] = {"triton": 3.0, "torch": 1.0}
    w = torch.randn(24, device=DEVICE)
    PF.layer_norm(torch.randn(60, 24, device=DEVICE), w)  # measures: each path runs once before timing
    assert fake.calls == [("layer_norm", "triton"), ("layer_norm", "torch")]
    assert spies == {"triton": 1, "torch": 2}           # + the call itself, on torch's path
    PF.layer_norm(torch.randn(64, 24, device=DEVICE), w)     # same bucket (<= 64 rows): cached
    PF.layer_norm(torch.randn(4, 15, 24, device=DEVICE), w)  # 60 rows in another layout: same class
    assert len(fake.calls) == 2 and spies == {"triton": 1, "torch": 4}
    PF.layer_norm(torch.randn(65, 24, device=DEVICE), w)  # next bucket: measured again
    PF.layer_norm(torch.randn(60, 32, device=DEVICE), torch.randn(32, device=DEVICE))  # another width
    assert len(fake.calls) == 6
    choices = dispatch.DISPATCHER.choices()
    assert choices[("layer_norm", str(w.device), torch.float32, 24, 64, False)] == dispatch.Choice("torch", 3.0, 1.0)
    assert {c.path for c in choices.values()} == {"torch"} and len(choices) == 3


def test_faster_triton_is_chosen_and_override_wins_over_the_cache(fake, spies, monkeypatch):
    x, w = torch.randn(8, 24, device=DEVICE), torch.randn(24, device=DEVICE)
    PF.layer_norm(x, w)
    assert spies["triton"] == 2 and dispatch.DISPATCHER.choices()[
        ("layer_norm", str(x.device), torch.float32, 24, 8, False)].path == "triton"
    monkeypatch.setenv(dispatch.ENV, "layer_norm:torch")
    PF.layer_norm(x, w)
    assert spies["torch"] == 2 and len(fake.calls) == 2  # 1 while measuring, 1 now; nothing re-timed
    dispatch.DISPATCHER.clear()
    monkeypatch.setenv(dispatch.ENV, "torch")
    PF.layer_norm(x, w)
    assert len(fake.calls) == 2 and dispatch.DISPATCHER.choices() == {}


def test_attention_shape_class_has_dtype_causal_and_head_dim(fake):
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    PF.attention(q, q, q, causal=True)
    PF.attention(q, q, q, causal=False)
    PF.attention(q.flip(2), q, q, causal=True)          # same shape class: cached
    keys = sorted(dispatch.DISPATCHER.choices(), key=str)
    assert keys == sorted([("attention", str(q.device), torch.float32, c, 16, 16, 2) for c in (True, False)], key=str)


def test_cross_entropy_auto_is_triton_without_timing(fake, monkeypatch):
    from pystronghold.kernels import cross_entropy

    calls = []
    monkeypatch.setattr(cross_entropy, "vocab_parallel_cross_entropy", lambda *a, **k: calls.append(1) or "triton")
    logits, target = torch.randn(4, 10, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    assert PF.vocab_parallel_cross_entropy(logits, target) == "triton"
    assert calls == [1] and fake.calls == [] and dispatch.DISPATCHER.choices() == {}


def test_a_refusing_kernel_picks_torch(fake):
    q = torch.randn(1, 1, 16, 8, device=DEVICE, requires_grad=True)  # head dim 8: the Triton kernel raises ValueError
    out = PF.attention(q, q, q, causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    (choice,) = dispatch.DISPATCHER.choices().values()
    assert choice.path == "torch" and choice.triton_s == float("inf") and fake.calls == [("attention", "torch")]


def test_measuring_leaves_the_callers_graph_and_grads_alone(fake):
    x = torch.randn(6, 24, device=DEVICE, requires_grad=True)
    w = torch.randn(24, device=DEVICE, requires_grad=True)
    y = PF.layer_norm(x, w)
    assert x.grad is None and w.grad is None
    y.sum().backward()
    x2, w2 = (t.detach().clone().requires_grad_() for t in (x, w))
    reference.layer_norm_reference(x2, w2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, atol=1e-5, rtol=1e-5)


def test_agreed_times_decide(monkeypatch, fake):
    dispatch.DISPATCHER.agree = lambda times: {"triton": times["triton"] + 5.0, "torch": times["torch"]}
    PF.rms_norm(torch.randn(4, 24, device=DEVICE), torch.randn(24, device=DEVICE))
    (choice,) = dispatch.DISPATCHER.choices().values()
    assert choice == dispatch.Choice("torch", 6.0, 2.0)  # the timer alone says triton


def _ranks_agree(rank: int, world: int) -> None:
    os.environ[PF.FORCE_ENV] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    seconds = [{"triton": 1.0, "torch": 2.0}, {"triton": 5.0, "torch": 1.0}][rank]  # rank 0 alone: triton
    dispatch.DISPATCHER = dispatch.Dispatcher(timer=lambda op, path, run: seconds[path], measured_devices=("cpu",))
    PF.rms_norm(torch.randn(4, 24), torch.randn(24))
    (choice,) = dispatch.DISPATCHER.choices().values()
    assert choice == dispatch.Choice("torch", 6.0, 3.0), choice


@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks on CPU tensors in the interpreter; on CUDA "
                    "test_agreed_times_decide covers summed times deciding, the CPU run the all_reduce")
def test_ranks_agree_on_the_path():
    run_ranks(_ranks_agree, 2)


# ---- both paths give the same numbers


def _op_cases():
    x, b, r = torch.randn(7, 40), torch.randn(40), torch.randn(7, 40)
    q = torch.randn(1, 2, 20, 16)
    target = torch.tensor([0, 5, -100, 32, 17, 2, 8])  # ids 33..39: padding columns
    return {
        "attention": ((q, q.flip(2), q.flip(3)), {"causal": True}),
        "layer_norm": ((x, 1 + 0.1 * b, b), {}),
        "rms_norm": ((x, 1 + 0.1 * b), {}),
        "bias_gelu": ((x, b), {}),
        "bias_dropout_add": ((x, b, r), {"p": 0.3, "training": False, "seed": 3}),
        "vocab_parallel_cross_entropy": ((3 * x, target), {"vocab_size": 33}),
    }


@pytest.mark.parametrize("op", list(_op_cases()))
def test_both_paths_agree(op, monkeypatch):
    monkeypatch.setenv(PF.FORCE_ENV, "1")
    args, kwargs = _op_cases()[op]
    args = [a.to(DEVICE) for a in args]  # drawn on CPU: the same numbers on every machine
    results = {}
    for path in dispatch.PATHS:
        monkeypatch.setenv(dispatch.ENV, f"{op}:{path}")
        leaves = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
        out = getattr(PF, op)(*leaves, **kwargs)
        out.backward(torch.linspace(-1, 1, out.numel(), device=DEVICE).reshape(out.shape))
        results[path] = (out, *[a.grad for a in leaves if a.is_floating_point()])
    # fp32 (TRITON_CPU.md); on a GPU the attention kernel's fp32 tl.dot is TF32 (about 1e-3 relative)
    tol = 1e-2 if op == "attention" and DEVICE == "cuda" else 1e-5
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_gpt_runs_the_dispatched_ops(monkeypatch):
    """Each kernel the GPT uses is reached through the dispatch, and both paths train alike."""
    from pystronghold.kernels import attention, cross_entropy, norms

    monkeypatch.setenv(PF.FORCE_ENV, "1")
    cfg = GPTConfig(vocab_size=50, vocab_pad_multiple=16, seq_len=16, layers=1, hidden=32, heads=2)
    idx = torch.randint(0, 50, (2, 16), device=DEVICE)
    counts = {}
    for module, name in ((attention, "attention"), (norms, "layer_norm"),
                         (cross_entropy, "vocab_parallel_cross_entropy")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k: counts.update({_n: counts.get(_n, 0) + 1})
                            or _r(*a, **k))
    results = {}
    for path in dispatch.PATHS:
        monkeypatch.setenv(dispatch.ENV, path)
        model = GPT(cfg, seed=1).to(DEVICE)
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        results[path] = [loss] + [p.grad for p in model.parameters()]
        if path == "triton":
            assert counts == {"attention": 1, "layer_norm": 3, "vocab_parallel_cross_entropy": 1}
    assert counts == {"attention": 1, "layer_norm": 3, "vocab_parallel_cross_entropy": 1}  # torch: none more
    tol = 1e-2 if DEVICE == "cuda" else 1e-5  # fp32; on a GPU the attention kernel's tl.dot is TF32
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
