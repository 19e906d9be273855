"""The SIMD variants of the native kernels (csrc/simd_<isa>.cpp) agree: each variant this CPU can
run is forced in its own process (PYSTRONGHOLD_SIMD_FORCE) and runs the same Adam steps and
gradient norms on the same data.

Adam: bit-identical across variants. Every variant performs the same IEEE fp32 operations in the
same order with the same explicit FMAs (csrc/adam_kernel.h; opaque() forbids other contractions),
and the scalar tail is the reference of the vector body, so the lane count cannot change a result.
grad_sq_norm: float64 partial sums per lane, so the summation order depends on the lane count;
rtol 1e-12 (each of n <= 2^17 terms adds at most n * 2^-53 relative error, ~1.5e-11 worst case;
in practice far less for sums of non-negative terms).
"""

import os
import subprocess
import sys

import pytest
import torch

from pystronghold._ext import native

SIZES = [1, 7, 17, 1023, 2**16 + 3]  # SIMD tails; the last one is split over OpenMP threads

RUN_VARIANT = r"""
import sys
import torch
from pystronghold._ext import native
from pystronghold.optim import AdamWHyper
from pystronghold.optim.functional import adam_step_, adam_step_multi_, grad_sq_norm

sizes = [int(s) for s in sys.argv[2].split(",")]
out = {"simd": native().simd_level()}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for mode in ("adamw", "adam_l2", "plain"):
        for bitwise in (False, True):
            for shadow_dtype in (None, torch.bfloat16, torch.float16):
                g = torch.Generator().manual_seed(len(out))
                params = [torch.randn(n, generator=g) for n in sizes]
                m = [torch.zeros(n) for n in sizes]
                v = [torch.zeros(n) for n in sizes]
                shadows = None if shadow_dtype is None else [torch.empty(n, dtype=shadow_dtype) for n in sizes]
                for step in range(1, 4):
                    grads = [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes]
                    hyper = AdamWHyper(step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                       weight_decay=0.0 if mode == "plain" else 0.1, adamw=mode == "adamw",
                                       grad_scale=0.5)
                    assert adam_step_multi_(params, grads, m, v, hyper, shadows=shadows, bitwise_torch=bitwise)
                key = f"{dtype}-{mode}-{bitwise}-{shadow_dtype}"
                out[key] = (params, m, v, shadows)
        out[f"norm-{dtype}"] = [grad_sq_norm((torch.randn(n, generator=g) * 7).to(dtype), 0.25) for n in sizes]
torch.save(out, sys.argv[1])
"""


def run_variant(variant: str, path, sizes=SIZES) -> dict:
    env = dict(os.environ, PYSTRONGHOLD_SIMD_FORCE=variant, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", RUN_VARIANT, str(path), ",".join(map(str, sizes))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


def test_every_variant_this_cpu_runs_gives_the_same_results(tmp_path):
    supported = native().simd_supported()
    assert "scalar" in supported and native().simd_level() == supported[0]  # the best one runs
    results = {v: run_variant(v, tmp_path / f"{v}.pt") for v in supported}
    reference = results["scalar"]
    for variant, got in results.items():
        assert got["simd"] == variant
        for key, want in reference.items():
            if key == "simd":
                continue
            if key.startswith("norm-"):
                torch.testing.assert_close(torch.tensor(got[key], dtype=torch.float64),
                                           torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
                continue
            for name, a_list, b_list in zip(("param", "exp_avg", "exp_avg_sq", "shadow"), got[key], want):
                for a, b in zip(a_list or [], b_list or []):
                    assert torch.equal(a, b), f"{variant} vs scalar: {key} {name} (n={a.numel()}) differs"


def test_the_variants_are_all_built():
    built = native().simd_variants()
    assert built[-1] == "scalar"
    machine = os.uname().machine
    if machine == "x86_64" and os.environ.get("PYSTRONGHOLD_SIMD", "all") == "all":
        assert built == ["avx512", "avx2", "scalar"]


@pytest.mark.parametrize("forced, words", [
    ("nosuch", "not a SIMD variant of this build; expected one of"),
])
def test_a_bad_forced_variant_fails_the_import_with_one_clear_line(forced, words):
    env = dict(os.environ, PYSTRONGHOLD_SIMD_FORCE=forced)
    proc = subprocess.run([sys.executable, "-m", "pystronghold", "info"], capture_output=True, text=True, env=env)
    assert proc.returncode == 1
    line = next(s for s in proc.stdout.splitlines() if s.startswith("extension"))
    assert f"PYSTRONGHOLD_SIMD_FORCE={forced}" in line and words in line and "make build" not in line


def test_info_names_the_forced_variant():
    env = dict(os.environ, PYSTRONGHOLD_SIMD_FORCE="scalar")
    proc = subprocess.run([sys.executable, "-m", "pystronghold", "info", "--json"], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    import json

    assert json.loads(proc.stdout)["simd"] == "scalar"
