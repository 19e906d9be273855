"""Benchmark of the Triton kernels (GPU) and of the CPU reference paths of pystronghold.nn.functional.

GPU (default when CUDA is available):
  attention   TFLOP/s of the flash-attention forward and forward+backward vs
              F.scaled_dot_product_attention; FLOPs 4*B*H*N^2*D forward, halved when causal, and
              2.5x that for the backward (so 3.5x for forward+backward).
  fused ops   time, GB/s (bytes the fused op must move) and peak memory (forward+backward) of
              layer_norm, rms_norm, bias_gelu, bias_dropout_add, cross-entropy vs their unfused torch
              sequences.
Without a GPU it says so and exits 0 (the Triton interpreter is never timed). `--cpu-reference`
times the CPU reference paths (what a CPU run of the model uses) against naive unfused torch, and
labels every figure as CPU.

  python bench/kernels.py [--quick] [--json PATH] [--cpu-reference [--threads N]]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, interleave, paired_ratio, print_table, write_json  # noqa: E402

import pystronghold.nn.functional as PF  # noqa: E402
from pystronghold.kernels import reference as ref  # noqa: E402
from pystronghold.nn import dispatch  # noqa: E402

# ---- naive unfused sequences (the baselines)


def naive_layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def naive_rms_norm(x, w, eps=1e-6):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_bias_gelu(x, b):
    z = x + b
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z.pow(3))))


def naive_bias_dropout_add(x, b, r, p=0.1):
    return F.dropout(x + b, p=p, training=True) + r


def naive_cross_entropy(logits, target):
    logp = logits - logits.exp().sum(-1, keepdim=True).log()
    return -logp.gather(1, target.unsqueeze(1)).mean()


def naive_attention(q, k, v, causal=True):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def fused_op_cases(device, dtype, rows, width, vocab):
    """(name, fused fn, unfused fn, make inputs, bytes moved by the fused forward) per op."""
    def mk(*shapes, grad=True):
        return lambda: [torch.randn(s, device=device, dtype=dtype, requires_grad=grad) for s in shapes]

    def ce_inputs():
        return [torch.randn(rows, vocab, device=device, dtype=dtype, requires_grad=True),
                torch.randint(0, vocab, (rows,), device=device)]

    el = dtype.itemsize
    return [
        ("layer_norm", lambda x, w, b: PF.layer_norm(x, w, b), naive_layer_norm,
         mk((rows, width), (width,), (width,)), 2 * rows * width * el),
        ("rms_norm", lambda x, w: PF.rms_norm(x, w), naive_rms_norm, mk((rows, width), (width,)),
         2 * rows * width * el),
        ("bias_gelu", lambda x, b: PF.bias_gelu(x, b), naive_bias_gelu, mk((rows, 4 * width), (4 * width,)),
         2 * rows * 4 * width * el),
        ("bias_dropout_add", lambda x, b, r: PF.bias_dropout_add(x, b, r, p=0.1, training=True, seed=1),
         naive_bias_dropout_add, mk((rows, width), (width,), (rows, width)), 3 * rows * width * el),
        ("cross_entropy", lambda lg, t: PF.vocab_parallel_cross_entropy(lg, t), naive_cross_entropy,
         ce_inputs, 2 * rows * vocab * el),
    ]


# ---- timing helpers


def _fwd_bwd(fn, inputs):
    def run():
        out = fn(*inputs)
        out.float().sum().backward() if out.dim() else out.backward()
        for t in inputs:
            t.grad = None
    return run


def _gpu_time(fn, quick):
    import triton.testing  # imported here: do_bench needs the GPU driver

    med, p20, p80 = triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100,
                                            quantiles=[0.5, 0.2, 0.8])
    return med / 1e3, p20 / 1e3, p80 / 1e3


def _peak_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


# ---- GPU benchmarks


def bench_attention_gpu(quick: bool) -> list[dict]:
    rows = []
    shapes = [(4, 16, 1024, 64)] if quick else [(4, 16, n, d) for n in (1024, 2048, 4096) for d in (64, 128)]
    for dtype in (torch.float16, torch.bfloat16):
        for batch, heads, n, d in shapes:
            for causal in (True, False):
                q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=True)
                           for _ in range(3))
                o = PF.attention(q, k, v, causal=causal)
                o_ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)   # correctness before timing
                flops = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
                do = torch.randn_like(o)
                for name, fn in (("triton", lambda: PF.attention(q, k, v, causal=causal)),
                                 ("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))):
                    fwd = _gpu_time(fn, quick)
                    fb = _gpu_time(lambda: torch.autograd.grad(fn(), (q, k, v), do), quick)
                    rows.append(dict(impl=name, dtype=str(dtype).split(".")[1], B=batch, H=heads, N=n, D=d,
                                     causal=causal, fwd_ms=fwd[0] * 1e3, fwd_tflops=flops / fwd[0] / 1e12,
                                     fwd_p20_ms=fwd[1] * 1e3, fwd_p80_ms=fwd[2] * 1e3, fwdbwd_ms=fb[0] * 1e3,
                                     fwdbwd_tflops=3.5 * flops / fb[0] / 1e12))
    return rows


def bench_fused_gpu(quick: bool) -> list[dict]:
    rows = []
    for name, fused, naive, make, nbytes in fused_op_cases("cuda", torch.bfloat16, 4096 if quick else 16384,
                                                           4096, 32768):
        inputs = make()
        for impl, fn in (("fused", fused), ("unfused", naive)):
            fwd = _gpu_time(lambda: fn(*inputs), quick)
            fb = _gpu_time(_fwd_bwd(fn, inputs), quick)
            rows.append(dict(op=name, impl=impl, fwd_ms=fwd[0] * 1e3, fwd_p20_ms=fwd[1] * 1e3,
                             fwd_p80_ms=fwd[2] * 1e3, fwd_GBps=nbytes / fwd[0] / 1e9, fwdbwd_ms=fb[0] * 1e3,
                             peak_MiB=_peak_bytes(_fwd_bwd(fn, inputs)) / 2**20))
    return rows


# ---- CPU reference benchmarks


def bench_cpu_reference(quick: bool) -> list[dict]:
    """CPU reference path (PF.* on CPU tensors) vs the naive unfused torch sequence, forward+backward,
    taking turns (A B A B ...); speedup = the paired ratio naive / reference (median, p20-p80)."""
    rows = []
    reps = 10 if quick else 20
    cases = fused_op_cases("cpu", torch.float32, 256 if quick else 2048, 1024, 8192)
    q_shape = (1, 4, 256, 64) if quick else (2, 8, 512, 64)
    cases.append(("attention", lambda q, k, v: PF.attention(q, k, v, causal=True), naive_attention,
                  lambda: [torch.randn(q_shape, requires_grad=True) for _ in range(3)], 0))
    for name, fused, naive, make, _ in cases:
        inputs = make()
        if name != "bias_dropout_add":       # different RNG streams: masks differ by design
            torch.testing.assert_close(fused(*inputs), naive(*inputs), atol=1e-4, rtol=1e-4)
        watch = LoadWatch()
        timings = interleave({"reference": _fwd_bwd(fused, inputs), "naive": _fwd_bwd(naive, inputs)},
                             rounds=reps, warmup=2)
        load = watch.stop().fields()
        for impl, t in timings.items():
            r = paired_ratio(timings["naive"], t)
            rows.append(dict(op=name, impl=impl, device="cpu", fwdbwd_ms=t.median_s * 1e3,
                             p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3, speedup=r.median,
                             speedup_p20=r.p20, speedup_p80=r.p80, **load))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--json", metavar="PATH", help="write the records with machine facts to PATH")
    parser.add_argument("--cpu-reference", action="store_true",
                        help="time the CPU reference paths vs naive torch (CPU figures, not the kernels)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 keeps a shared machine's figures steady)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_reference:
        rows = bench_cpu_reference(args.quick)
        print_table(rows, ["op", "impl", "device", "fwdbwd_ms", "p20_ms", "p80_ms", "speedup", "speedup_p20",
                           "speedup_p80", "load"],
                    f"CPU reference paths vs naive unfused torch, fp32, forward+backward "
                    f"({torch.get_num_threads()} threads)")
        write_json(args.json, "kernels-cpu-reference", rows)
        return 0
    # NOTE: the "triton"/"fused" rows time our kernels, not the dispatch's choice
    os.environ[dispatch.ENV] = "triton"
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA GPU here; the Triton kernels are benchmarked on a GPU only (the "
              "interpreter is not timed). Use --cpu-reference for the CPU reference paths.")
        return 0
    attn_rows = bench_attention_gpu(args.quick)
    print_table(attn_rows, ["impl", "dtype", "B", "H", "N", "D", "causal", "fwd_ms", "fwd_tflops",
                            "fwdbwd_ms", "fwdbwd_tflops"], f"attention on {torch.cuda.get_device_name()}")
    fused_rows = bench_fused_gpu(args.quick)
    print_table(fused_rows, ["op", "impl", "fwd_ms", "fwd_GBps", "fwdbwd_ms", "peak_MiB"],
                "fused ops vs unfused torch, bf16")
    write_json(args.json, "kernels-gpu", attn_rows + fused_rows, {"gpu": torch.cuda.get_device_name()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
