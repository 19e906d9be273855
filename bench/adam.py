"""Fused CPU Adam benchmark: M params/s and effective GB/s against torch, DeepSpeed and a roofline.

Cases, each at every size (total parameters) as 1 tensor and as 100 tensors:
  ours             pystronghold adam_step_ (fp32 grad, with the non-finite pre-scan); 100 tensors
                   go through one adam_step_multi_ call (one parallel region)
  ours_nocheck     the same with check_finite=False (caller already checked, e.g. grad_sq_norm)
  ours_bitwise     the same as ours_nocheck with bitwise_torch=True (torch's MKL sqrt, bit-identical)
  torch_fused      torch.optim.AdamW(fused=True)
  torch_foreach    torch.optim.AdamW(foreach=True)
  deepspeed        deepspeed.ops.adam.DeepSpeedCPUAdam (when importable; `make deepspeed`)
  roofline         the memory ceiling (bench/roofline.py): the fastest of several memory kernels
                   (read, fill, copy with ordinary and streaming stores, triad, Adam-shaped in-place
                   stream; 1..N threads), probed at each size; the fastest at each thread count then
                   take turns with the cases, and of_roofline is, per round, a case's GB/s over the
                   best kernel's GB/s in that round (median, p20-p80)
Offload pipeline (bf16 grad in, fp32 update, bf16 shadow out):
  ours_offload     one adam_step_ call with a bf16 grad and a bf16 shadow
  ds_offload       grad.float() into a buffer, DeepSpeedCPUAdam.step(), shadow.copy_(param)
  torch_offload    the same sequence with torch fused AdamW
Effective GB/s counts the bytes a one-pass update must move: 28 per parameter (fp32 grad), 28 for
the offload case (bf16 grad 2 + bf16 shadow 2), whatever an implementation really moves.
Timing is paired (bench/common.py): at each size and layout every case takes its turn once per round,
A B C ... A B C ..., and each ratio (x torch fused, x DeepSpeed, fraction of the roofline) is the
median of the per-round ratios with its p20-p80. Each record carries the load at its start and end.

Examples:
  python bench/adam.py --quick
  python bench/adam.py --sizes 64 --tensors 1,100 --json bench/results/adam.json
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MIN_PAIRS, LoadWatch, interleave, machine_facts, paired_ratio, print_table, write_json  # noqa: E402
from roofline import Probe, ceiling_fraction, measure  # noqa: E402

from pystronghold._ext import native  # noqa: E402
from pystronghold.optim import AdamWHyper, adam_step_, adam_step_multi_  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def hyper(step: int) -> AdamWHyper:
    """HP at ``step``; made at every call, as the runtime makes one per update."""
    return AdamWHyper(step=step, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                      weight_decay=HP["weight_decay"])


# ---- optional DeepSpeed

def deepspeed_adam():
    """DeepSpeedCPUAdam class, or None (with the reason) when it cannot be imported or built."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        probe = torch.nn.Parameter(torch.zeros(8))
        probe.grad = torch.ones(8)
        DeepSpeedCPUAdam([probe], lr=1e-3).step()  # builds/loads the op now, not while timing
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# ---- cases: each returns a step function over fresh buffers

def split(n, tensors):
    base, extra = divmod(n, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


def make_params(n, tensors):
    params = []
    for k in split(n, tensors):
        p = torch.nn.Parameter(torch.empty(k).uniform_(-1, 1))  # uniform_: faster to fill than randn
        p.grad = torch.empty(k).uniform_(-1e-2, 1e-2)
        params.append(p)
    return params


def case_ours(n, tensors, check_finite=True, offload=False, bitwise_torch=False):
    bufs = []
    for k in split(n, tensors):
        grad = torch.empty(k).uniform_(-1e-2, 1e-2)
        bufs.append((torch.empty(k).uniform_(-1, 1), grad.to(torch.bfloat16) if offload else grad,
                     torch.zeros(k), torch.zeros(k), torch.empty(k, dtype=torch.bfloat16) if offload else None))
    step = [0]

    cols = [list(c) for c in zip(*bufs)]  # params, grads, exp_avgs, exp_avg_sqs, shadows

    def fn():
        step[0] += 1
        if len(bufs) == 1:
            p, g, m, v, sh = bufs[0]
            adam_step_(p, g, m, v, hyper(step[0]), shadow=sh, check_finite=check_finite,
                       bitwise_torch=bitwise_torch)
        else:
            adam_step_multi_(*cols[:4], hyper(step[0]), shadows=cols[4] if offload else None,
                             check_finite=check_finite, bitwise_torch=bitwise_torch)
    return fn


def torch_opt(params, kind, ds_cls):
    kw = dict(lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"])
    if kind == "deepspeed":
        return ds_cls(params, adamw_mode=True, **kw)
    return torch.optim.AdamW(params, **{kind: True}, **kw)


def case_torch(n, tensors, kind, ds_cls=None):
    opt = torch_opt(make_params(n, tensors), kind, ds_cls)
    return opt.step


def case_offload_sequence(n, tensors, kind, ds_cls=None):
    params = make_params(n, tensors)
    grads_bf16 = [torch.empty(p.numel()).uniform_(-1e-2, 1e-2).to(torch.bfloat16) for p in params]
    shadows = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in params]
    opt = torch_opt(params, kind, ds_cls)

    def fn():
        for p, g in zip(params, grads_bf16):
            p.grad.copy_(g)          # cast grad bf16 -> fp32
        opt.step()
        for p, sh in zip(params, shadows):
            sh.copy_(p.detach())     # cast the updated master to the bf16 shadow
    return fn


# ---- correctness before timing

def check_correctness(ds_cls):
    """One step of every implementation from the same state agrees with torch's single-tensor AdamW:
    ours bit for bit with bitwise_torch=True, the default within 1 ulp of each update (IEEE sqrt),
    the others within 1e-5 (their own roundings); the multi-tensor and offload paths equal the
    single call."""
    n = 100_003
    ref = [torch.nn.Parameter(torch.randn(n))]
    ref[0].grad = torch.randn(n)
    start = ref[0].detach().clone()
    torch.optim.AdamW(ref, foreach=False, lr=HP["lr"], weight_decay=HP["weight_decay"]).step()
    p, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    adam_step_(p, ref[0].grad, m, v, hyper(1), bitwise_torch=True)
    assert torch.equal(p, ref[0].detach()), "ours (bitwise_torch=True) differs from torch.optim.AdamW"
    p, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    adam_step_(p, ref[0].grad, m, v, hyper(1))
    torch.testing.assert_close(p, ref[0].detach(), rtol=1e-6, atol=1e-5 * HP["lr"])
    halves = [t.split(n // 2) for t in (start.clone(), ref[0].grad, torch.zeros(n), torch.zeros(n))]
    adam_step_multi_(*[list(h) for h in halves], hyper(1))
    assert torch.equal(torch.cat(halves[0]), p), "adam_step_multi_ differs from adam_step_"
    q, shadow = start.clone(), torch.empty(n, dtype=torch.bfloat16)
    adam_step_(q, ref[0].grad.bfloat16(), torch.zeros(n), torch.zeros(n), hyper(1), shadow=shadow)
    assert torch.equal(shadow, q.bfloat16()), "offload shadow is not the cast of the master"
    for kind in ["fused", "foreach"] + (["deepspeed"] if ds_cls else []):
        q = [torch.nn.Parameter(start.clone())]
        q[0].grad = ref[0].grad.clone()
        torch_opt(q, kind, ds_cls).step()
        torch.testing.assert_close(q[0].detach(), p, rtol=1e-5, atol=1e-7, msg=lambda s: f"{kind}: {s}")


# ---- driver

def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


BYTES_PER_PARAM = 28
PROBE_MIN_VALUES = 1 << 24
"""The probe's arrays hold at least this many fp32 values (64 MiB each): beyond the last-level cache,
so the ceiling is the memory's; an update whose working set fits in cache can exceed it."""
BASELINES = {"plain": ("torch_fused", "deepspeed"), "offload": ("torch_offload", "ds_offload")}
"""The baselines each kind of case is compared with (paired ratios x_<baseline>)."""


def case_bytes(name: str, n: int) -> int:
    """Host bytes a case allocates at n parameters: fp32 p, g, m, v; the offload case has a bf16 grad
    and shadow instead of the fp32 grad; the cast-step-cast sequences keep both."""
    return {"ours_offload": 16 * n, "ds_offload": 20 * n, "torch_offload": 20 * n}.get(name, 16 * n)


def measure_group(fns: dict, n: int, rounds: int, warmup: int, leaders: list) -> list[dict]:
    """Interleave the cases of one size and layout with the probe's leading kernels (none: no
    roofline); records with paired ratios against the baselines and fractions of each round's
    ceiling (the fastest leader in that round)."""
    kernels = {f"roofline {k.label}": k for k in leaders}
    fns = dict(fns, **{name: k.fn for name, k in kernels.items()})
    watch = LoadWatch()
    times = interleave(fns, rounds=rounds, warmup=warmup)
    load = watch.stop().fields()
    by_label = {k.label: times[name] for name, k in kernels.items()}
    records = []
    for name, t in times.items():
        nbytes = kernels[name].nbytes if name in kernels else n * BYTES_PER_PARAM
        rec = {"case": name, "median_ms": t.median_s * 1e3, "p20_ms": t.p20_s * 1e3, "p80_ms": t.p80_s * 1e3,
               "pairs": t.reps, "mparams_s": "-" if name in kernels else n / t.median_s / 1e6,
               "gb_s": nbytes / t.median_s / 1e9, **load}
        if kernels:
            frac = ceiling_fraction(by_label, leaders, t.samples_s, nbytes)
            rec.update(of_roofline=frac.median, of_roofline_p20=frac.p20, of_roofline_p80=frac.p80)
        if name.startswith("ours"):
            for base in BASELINES["offload" if "offload" in name else "plain"]:
                if base in times:
                    r = paired_ratio(times[base], t)
                    rec.update({f"x_{base}": r.median, f"x_{base}_p20": r.p20, f"x_{base}_p80": r.p80})
        records.append(rec)
    return records


def ratio_label(rec: dict, key: str) -> str:
    """``1.06 (1.01-1.10)`` from a record's median and p20/p80 fields, or "" when absent."""
    if key not in rec:
        return ""
    return f"{rec[key]:.2f} ({rec[key + '_p20']:.2f}-{rec[key + '_p80']:.2f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16,64,256", help="total parameters, in millions (2^20), comma-separated")
    ap.add_argument("--tensors", default="1,100", help="numbers of tensors the parameters are split into")
    ap.add_argument("--cases", default="all", help="comma-separated case names, or all")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds (pairs) per size and layout, >= 10")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=2, help="threads for torch, OpenMP and DeepSpeed")
    ap.add_argument("--quick", action="store_true", help="4M params only, no foreach/bitwise: about half a minute")
    ap.add_argument("--json", default=None, help="write the records to this JSON file")
    args = ap.parse_args(argv)
    if args.rounds < MIN_PAIRS:
        ap.error(f"--rounds {args.rounds}: the paired ratios need at least {MIN_PAIRS}")
    if args.quick:
        args.sizes, args.tensors = "4", "1,100"
    torch.set_num_threads(args.threads)
    native().set_num_threads(args.threads)
    ds_cls, ds_reason = deepspeed_adam()
    if ds_cls is None:
        print(f"DeepSpeedCPUAdam not available ({ds_reason}); `make deepspeed` installs it")
    check_correctness(ds_cls)

    cases = {
        "ours": lambda n, t: case_ours(n, t),
        "ours_nocheck": lambda n, t: case_ours(n, t, check_finite=False),
        "ours_bitwise": lambda n, t: case_ours(n, t, check_finite=False, bitwise_torch=True),
        "torch_fused": lambda n, t: case_torch(n, t, "fused"),
        "torch_foreach": lambda n, t: case_torch(n, t, "foreach"),
        "deepspeed": lambda n, t: case_torch(n, t, "deepspeed", ds_cls),
        "ours_offload": lambda n, t: case_ours(n, t, offload=True),
        "ds_offload": lambda n, t: case_offload_sequence(n, t, "deepspeed", ds_cls),
        "torch_offload": lambda n, t: case_offload_sequence(n, t, "fused"),
    }
    wanted = list(cases) + ["roofline"] if args.cases == "all" else args.cases.split(",")
    unknown = [c for c in wanted if c not in cases and c != "roofline"]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {', '.join([*cases, 'roofline'])}")
    if ds_cls is None:
        wanted = [c for c in wanted if c not in ("deepspeed", "ds_offload")]
    if args.quick:
        wanted = [c for c in wanted if c not in ("torch_foreach", "ours_bitwise")]
    records = []
    for size_m in [float(s) for s in args.sizes.split(",")]:
        n = int(size_m * 2**20)
        need = sum(case_bytes(c, n) for c in wanted if c != "roofline")
        need += 16 * max(n, PROBE_MIN_VALUES) if "roofline" in wanted else 0  # the probe's four arrays
        if need > 0.7 * mem_available_bytes():
            print(f"skip {size_m:g}M params: the cases need ~{need / 2**30:.1f} GiB together, "
                  f"{mem_available_bytes() / 2**30:.1f} GiB available")
            continue
        probe, leaders = None, []
        if "roofline" in wanted:
            probe = Probe(max(n, PROBE_MIN_VALUES), args.threads)
            leaders, probe_records = measure(probe, rounds=args.rounds, warmup=args.warmup)
            for r in probe_records:
                records.append({"case": f"probe {r['kernel']} x{r['threads']}", "params_m": size_m, **r})
        for tensors in [int(t) for t in args.tensors.split(",")]:
            fns = {name: cases[name](n, tensors) for name in wanted if name != "roofline"}
            for rec in measure_group(fns, n, args.rounds, args.warmup, leaders):
                rec.update(params_m=size_m, tensors=tensors)
                records.append(rec)
                print(f"{rec['case']:>14} {size_m:g}M x{tensors}: {rec['median_ms']:.2f} ms "
                      f"({rec['p20_ms']:.2f}-{rec['p80_ms']:.2f}), {rec['gb_s']:.1f} GB/s, load {rec['load']}",
                      flush=True)
            del fns
            gc.collect()
        if probe is not None:
            probe.close()
            del probe, leaders
            gc.collect()
    for rec in records:
        for key in ("x_torch_fused", "x_deepspeed", "x_torch_offload", "x_ds_offload", "of_roofline"):
            rec[f"{key} (p20-p80)"] = ratio_label(rec, key)
    columns = ["case", "params_m", "tensors", "median_ms", "p20_ms", "p80_ms", "mparams_s", "gb_s",
               "of_roofline (p20-p80)", "x_torch_fused (p20-p80)", "x_deepspeed (p20-p80)",
               "x_torch_offload (p20-p80)", "x_ds_offload (p20-p80)", "load"]
    facts = machine_facts()
    print_table([r for r in records if not r["case"].startswith("probe")], columns,
                title=f"fused CPU Adam, {args.threads} threads, {facts['cpu']}, simd={facts.get('simd')}, "
                      f"torch {facts['torch']}; ratios are paired over {args.rounds} rounds: median (p20-p80)")
    print_table([r for r in records if r["case"].startswith("probe")],
                ["case", "params_m", "median_ms", "gb_s", "of_ceiling", "of_ceiling_p20", "of_ceiling_p80", "load"],
                title="roofline probe: memory kernels as a fraction of the fastest (the ceiling)")
    write_json(args.json, "adam", records, extra={"deepspeed": ds_reason or "available",
                                                  "argv": sys.argv[1:]})
    return records


if __name__ == "__main__":
    main()
