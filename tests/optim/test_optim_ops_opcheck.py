"""torch.ops.pystronghold.*: schemas that declare what each op writes, torch.library.opcheck passes
(schema, fake tensor, functionalization through AOT dispatch), and torch.compile traces them in one
graph with the eager results, bit for bit."""

import pytest
import torch
from torch.library import opcheck

from pystronghold.ops import OPS, native_ops
from pystronghold.optim import AdamWHyper
from pystronghold.optim.functional import adam_step_, adam_step_multi_


@pytest.fixture(autouse=True)
def operators_registered():
    """torch.ops.pystronghold.* exist once _C is loaded; native_ops() also registers the fakes."""
    native_ops()


# step, lr, beta1, beta2, eps, weight_decay, adamw, grad_scale, check_finite, bitwise_torch
SCALARS = (3, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, 0.5, True, False)


def adam_set(n, grad_dtype=torch.float32, shadow_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g).to(grad_dtype), torch.randn(n, generator=g),
            torch.rand(n, generator=g), None if shadow_dtype is None else torch.empty(n, dtype=shadow_dtype))


ADAM_SAMPLES = [
    (*adam_set(7), *SCALARS),
    (*adam_set(17, torch.bfloat16, torch.bfloat16, seed=1), *SCALARS),
    (*adam_set(1023, torch.float16, torch.float16, seed=2), 1, 1e-3, 0.8, 0.99, 1e-6, 0.0, False, 1.0, False, True),
]


def multi_sample(sizes, shadow_dtype=None):
    sets = [adam_set(n, torch.bfloat16 if shadow_dtype else torch.float32, shadow_dtype, seed=n) for n in sizes]
    lists = [list(col) for col in zip(*sets)]
    return (*lists[:4], lists[4] if shadow_dtype else None, *SCALARS)


SAMPLES = {
    "adam_step": ADAM_SAMPLES,
    "adam_step_multi": [multi_sample([7, 17, 1]), multi_sample([3, 1023], torch.bfloat16)],
    "grad_sq_norm": [(torch.randn(1023), 0.5), (torch.randn(17).bfloat16(), 1.0), (torch.randn(7).half(), 2.0)],
    "param_grad_norms": [([torch.randn(1023), torch.randn(7, 3)], 0.5),
                         ([torch.randn(17).bfloat16(), torch.randn(1).half()], 1.0)],
    "crc32c": [(torch.arange(100, dtype=torch.uint8), False), (torch.randn(33), True)],
}


@pytest.mark.parametrize("name", OPS)
def test_op_passes_torch_opcheck(name):
    op = getattr(native_ops(), name)
    for args in SAMPLES[name]:
        opcheck(op, args)


@pytest.mark.parametrize("name,written", [
    ("adam_step", {"param", "exp_avg", "exp_avg_sq", "shadow"}),
    ("adam_step_multi", {"params", "exp_avgs", "exp_avg_sqs", "shadows"}),
    ("grad_sq_norm", set()),
    ("param_grad_norms", set()),
    ("crc32c", set()),
])
def test_schema_declares_exactly_the_written_arguments(name, written):
    schema = getattr(native_ops(), name)._schema
    declared = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert declared == written
    assert all(r.alias_info is None for r in schema.returns)  # results are new tensors


def test_adam_step_under_torch_compile_matches_eager():
    def update(p, g, m, v, sh):
        applied = torch.ops.pystronghold.adam_step(p, g, m, v, sh, *SCALARS)
        return applied, p.sum(), sh.float() * 2  # uses of the updated buffers after the in-place op

    eager, compiled = adam_set(4099, torch.bfloat16, torch.bfloat16), None
    compiled = tuple(t.clone() for t in eager)
    want = update(*eager)
    got = torch.compile(update, fullgraph=True, backend="aot_eager")(*compiled)
    for a, b in zip((*want, *eager), (*got, *compiled)):
        assert torch.equal(a, b)


def test_adam_step_multi_and_norm_under_torch_compile_match_eager():
    def update(params, grads, ms, vs):
        norm = torch.ops.pystronghold.grad_sq_norm(grads[0], 0.5)
        applied = torch.ops.pystronghold.adam_step_multi(params, grads, ms, vs, None, *SCALARS)
        return norm, applied, torch.cat(params)

    eager = multi_sample([7, 1023, 17])[:4]
    compiled = [[t.clone() for t in col] for col in eager]
    want = update(*eager)
    got = torch.compile(update, fullgraph=True, backend="aot_eager")(*compiled)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    for col_a, col_b in zip(eager, compiled):
        assert all(torch.equal(a, b) for a, b in zip(col_a, col_b))


def test_the_wrappers_call_the_operators():
    # adam_step_ and adam_step_multi_ unpack one AdamWHyper into the operator's arguments
    p, g, m, v, _ = adam_set(1023)
    direct = [t.clone() for t in (p, g, m, v)]
    hyper = AdamWHyper(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    assert adam_step_(p, g, m, v, hyper) is True
    assert torch.ops.pystronghold.adam_step(*direct, None, *SCALARS).item() is True
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), (direct[0], direct[2], direct[3])))
    assert adam_step_multi_([p], [g], [m], [v], hyper) is True


FIRST_CALLS_AT_ONCE = """
import threading
from pystronghold.ops import native_ops

start, errors, got = threading.Barrier(8), [], []
def first_call():
    start.wait()
    try:
        got.append(native_ops())
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=first_call) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert not errors, errors
assert len(got) == 8 and all(ops is got[0] for ops in got)
print("ok")
"""


def test_first_calls_from_several_threads_at_once_load_the_operators_once():
    """A worker's first host update and the main thread's first grad norm may ask for the operators
    at the same moment (a pipeline rank did, and its second fake registration raised)."""
    import subprocess
    import sys

    for _ in range(3):  # a fresh interpreter each time: the first calls are the ones that race
        p = subprocess.run([sys.executable, "-c", FIRST_CALLS_AT_ONCE], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
