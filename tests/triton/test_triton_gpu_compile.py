"""Compile every Triton kernel for NVIDIA GPUs (sm_80, sm_90) to PTX and cubin, with no GPU needed.

The interpreter does not enforce what a GPU needs (dot shapes >= 16, legal layouts, types, shared
memory); Triton's compiler does, and it runs without a device. Opt-in, since it costs about a minute
of CPU: `PYSTRONGHOLD_GPU_COMPILE_CHECK=1 pytest tests/triton/test_triton_gpu_compile.py`. The compile runs
in a child process, because this pytest process decorates the kernels for the interpreter.
"""

import os
import subprocess
import sys

import pytest

P16, PBF, P32 = "*fp16", "*bf16", "*fp32"


def _cases():
    """(module, kernel, pointer/scalar types by argument, constexprs, options) for each compile."""
    ptr = lambda names, t: {n: t for n in names}  # noqa: E731
    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    cases = []
    for t, d, causal, (bm, bn), warps, precision in ((P16, 64, True, (128, 64), 4, "tf32"),
                                                     (PBF, 128, False, (128, 64), 8, "tf32"),
                                                     (P32, 64, True, (64, 32), 4, "tf32"),
                                                     (P32, 64, True, (64, 32), 4, "ieee")):
        cases.append(("attention", "_attn_fwd_kernel", {**ptr("Q K V O".split(), t), "LSE": P32, "qk_scale": "fp32",
                                                        **ints("n_ctx", "head_dim")},
                      dict(CAUSAL=causal, UPCAST=False, PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d),
                      dict(num_warps=warps, num_stages=3)))
    for t, d, precision in ((P16, 64, "tf32"), (PBF, 128, "tf32"), (P32, 64, "ieee")):
        common = {**ptr("Q K V DO".split(), t), "LSE": P32, "DELTA": P32, "sm_scale": "fp32", "qk_scale": "fp32",
                  **ints("n_ctx", "head_dim")}
        consts = dict(CAUSAL=True, UPCAST=False, PRECISION=precision, BLOCK_M=64, BLOCK_N=64, BLOCK_D=d)
        cases.append(("attention", "_attn_bwd_dkdv_kernel", {**common, "DK": t, "DV": t}, consts, dict(num_warps=4, num_stages=2)))
        cases.append(("attention", "_attn_bwd_dq_kernel", {**common, "DQ": t}, consts, dict(num_warps=4, num_stages=2)))
    for t, is_rms, block, warps in ((P16, False, 1024, 4), (PBF, True, 16384, 16)):
        cases.append(("norms", "_norm_fwd_kernel", {**ptr("X W B Y".split(), t), "Mean": P32, "Rstd": P32,
                                                    **ints("stride_x", "stride_y", "n_cols"), "eps": "fp32"},
                      dict(IS_RMS=is_rms, HAS_BIAS=not is_rms, BLOCK_N=block), dict(num_warps=warps)))
        cases.append(("norms", "_norm_bwd_kernel", {**ptr("DY X W DX".split(), t), "Mean": P32, "Rstd": P32,
                                                    "DW_partial": P32, "DB_partial": P32,
                                                    **ints("stride_x", "n_rows", "n_cols", "rows_per_program")},
                      dict(IS_RMS=is_rms, HAS_BIAS=not is_rms, BLOCK_N=block), dict(num_warps=warps)))
    for tanh in (True, False):
        cases.append(("bias_gelu", "_bias_gelu_fwd_kernel", {**ptr("X B Y".split(), PBF), **ints("n_elements", "n_cols")},
                      dict(TANH=tanh, BLOCK=4096), dict(num_warps=8)))
        cases.append(("bias_gelu", "_bias_gelu_bwd_kernel", {**ptr("DY X B DX".split(), PBF), **ints("n_elements", "n_cols")},
                      dict(TANH=tanh, BLOCK=1024), dict(num_warps=4)))
    cases.append(("bias_dropout_add", "_bias_dropout_add_fwd_kernel",
                  {**ptr("X B R Y".split(), P16), "n_elements": "i64", "n_cols": "i32", "p": "fp32", "seed": "i64",
                   "offset": "i64"}, dict(HAS_BIAS=True, BLOCK=2048), dict(num_warps=8)))
    cases.append(("bias_dropout_add", "_bias_dropout_add_bwd_kernel",
                  {**ptr("DY DX".split(), P16), "n_elements": "i64", "p": "fp32", "seed": "i64", "offset": "i64"},
                  dict(BLOCK=1024), dict(num_warps=4)))
    cases.append(("cross_entropy", "_ce_stats_kernel", {"X": PBF, "T": "*i64", **ptr("M S TGT SUMX".split(), P32),
                                                        **ints("stride_x", "n_cols", "vocab_start", "vocab", "ignore_index")},
                  dict(BLOCK_V=4096), dict(num_warps=8)))
    cases.append(("cross_entropy", "_ce_loss_grad_kernel",
                  {"X": PBF, "T": "*i64", **ptr("LSE TGT SUMX SCALE LOSS".split(), P32), "DX": PBF,
                   **ints("stride_x", "stride_dx", "n_cols", "vocab_start", "vocab", "ignore_index"), "eps": "fp32"},
                  dict(WRITE_GRAD=True, BLOCK_V=4096), dict(num_warps=8)))
    return cases


def compile_all(capabilities=(80, 90)) -> list[str]:
    """Compile every case for every capability; returns one line per compiled kernel."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for module, name, types, consts, options in _cases():
        kernel = getattr(importlib.import_module(f"pystronghold.kernels.{module}"), name)
        fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
        params = [p.name for p in fn.params]
        signature = {p: ("constexpr" if p in consts else types[p]) for p in params}
        missing = set(params) - set(signature)
        assert not missing, f"{name}: no type for {missing}"
        for cap in capabilities:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts),
                                      target=GPUTarget("cuda", cap, 32), options=options)
            assert compiled.asm.get("cubin"), f"{name} sm_{cap}: no cubin"
            lines.append(f"{name} sm_{cap} {consts} {options}: {compiled.metadata.shared} B shared")
    return lines


@pytest.mark.skipif(os.environ.get("PYSTRONGHOLD_GPU_COMPILE_CHECK") != "1",
                    reason="opt-in: set PYSTRONGHOLD_GPU_COMPILE_CHECK=1 (about a minute of CPU)")
def test_kernels_compile_for_nvidia_gpus():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYSTRONGHOLD_TRITON_ON_CPU")}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" B shared") == 2 * len(_cases())


if __name__ == "__main__":
    for line in compile_all():
        print(line, flush=True)
