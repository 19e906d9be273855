"""Memory roofline probe: the fastest of several memory kernels, timed in the same run, as this
machine's ceiling in bytes/s; every other figure is reported as a fraction of it.

Kernels over arrays of n fp32 values, each at 1..N threads (torch's intra-op threads, the native
OpenMP threads, or the copy engine's threads):
  read       torch.sum(a)                                   4 B/element read
  fill       a.fill_(x), ordinary stores                    4 B written
  copy       b.copy_(a), ordinary stores                    8 B
  copy_nt    CopyEngine.copy(b, a): streaming (non-temporal) stores from 1 MiB chunks up      8 B
  memcpy     glibc memcpy, one call (1 thread; large copies use its own streaming path)        8 B
  triad      torch.add(b, c, alpha=s, out=a)                12 B
  adam_shape csrc/adam.cpp:     a, b, c <- x*s + d in place, Adam's access pattern             28 B
Bytes counted are those the kernel names (reads plus writes), not the read-for-ownership an ordinary
store adds, so a kernel whose stores need one looks slower than the bus really ran: the ceiling is
the best any of them reached, which a one-pass kernel moving the same counted bytes cannot exceed
by more than the noise. The kernels take turns (``common.interleave``); in each round the ceiling is
the highest GB/s any kernel reached in that round, and a kernel's (or an Adam case's) fraction of the
ceiling is the median (p20-p80) over the rounds of its GB/s / that round's ceiling. The probe's
``leaders`` (the fastest kernel at each thread count) take turns with the cases of bench/adam.py.

    .venv/bin/python bench/roofline.py [--mparams 64] [--threads 2] [--json bench/results/roofline.json]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, Ratio, Timing, interleave, print_table, write_json  # noqa: E402

from pystronghold._ext import native  # noqa: E402
from pystronghold.io import CopyEngine  # noqa: E402


@dataclass
class Kernel:
    """One memory kernel: a name, its threads, the bytes one call moves, and the call."""

    name: str
    threads: int
    nbytes: int
    fn: Callable[[], object]

    @property
    def label(self) -> str:
        return f"{self.name} x{self.threads}"


def _with_threads(threads: int, op: Callable[[], object]) -> Callable[[], None]:
    """``op`` run with ``threads`` torch and native threads, the caller's counts restored after."""
    def fn() -> None:
        torch_before, native_before = torch.get_num_threads(), native().get_num_threads()
        torch.set_num_threads(threads)
        native().set_num_threads(threads)
        try:
            op()
        finally:
            torch.set_num_threads(torch_before)
            native().set_num_threads(native_before)
    return fn


class Probe:
    """The kernels over four arrays of ``n`` fp32 values, 1..``max_threads`` threads; ``close()``
    stops the copy engines."""

    def __init__(self, n: int, max_threads: int) -> None:
        if n < 1 or max_threads < 1:
            raise ValueError(f"Probe: n={n} and max_threads={max_threads} must be >= 1")
        a, b, c, d = (torch.empty(n).uniform_(-1, 1) for _ in range(4))
        stream = native().roofline_stream
        self.engines = {t: CopyEngine(threads=t, queues=1) for t in range(1, max_threads + 1)}
        self.kernels = [Kernel("memcpy", 1, 8 * n, lambda: native().memcpy_probe(b, a))]
        for t in range(1, max_threads + 1):
            eng = self.engines[t]
            self.kernels += [
                Kernel("read", t, 4 * n, _with_threads(t, lambda: a.sum())),
                Kernel("fill", t, 4 * n, _with_threads(t, lambda: d.fill_(0.5))),
                Kernel("copy", t, 8 * n, _with_threads(t, lambda: b.copy_(a))),
                Kernel("copy_nt", t, 8 * n, lambda eng=eng: eng.copy(b, a).wait()),
                Kernel("triad", t, 12 * n, _with_threads(t, lambda: torch.add(b, c, alpha=0.5, out=a))),
                Kernel("adam_shape", t, 28 * n, _with_threads(t, lambda: stream(a, b, c, d, 0.999))),
            ]

    def close(self) -> None:
        for eng in self.engines.values():
            eng.close()


def ceiling_fraction(times: dict[str, Timing], kernels: list[Kernel], samples_s: list[float],
                     nbytes: int) -> Ratio:
    """Per round: (nbytes / samples_s[i]) / the highest GB/s of ``kernels`` in round i; their median
    and p20-p80. ``times`` holds the kernels' timings by label, from the same ``interleave``."""
    fractions = []
    for i, s in enumerate(samples_s):
        ceiling = max(k.nbytes / times[k.label].samples_s[i] for k in kernels)
        fractions.append(nbytes / s / ceiling)
    return Ratio.of(fractions)


def measure(probe: Probe, *, rounds: int = 10, warmup: int = 2) -> tuple[list[Kernel], list[dict]]:
    """Time every kernel taking turns; return the leaders (the fastest kernel, by median GB/s, at each
    thread count, fastest first) and one record per kernel with its GB/s and fraction of the ceiling."""
    watch = LoadWatch()
    times = interleave({k.label: k.fn for k in probe.kernels}, rounds=rounds, warmup=warmup)
    load = watch.stop().fields()
    gbs = {k.label: k.nbytes / times[k.label].median_s / 1e9 for k in probe.kernels}
    leaders = {}
    for k in sorted(probe.kernels, key=lambda k: -gbs[k.label]):
        leaders.setdefault(k.threads, k)
    records = []
    for k in probe.kernels:
        t = times[k.label]
        frac = ceiling_fraction(times, probe.kernels, t.samples_s, k.nbytes)
        records.append({"kernel": k.name, "threads": k.threads, "bytes_per_call": k.nbytes,
                        "median_ms": t.median_s * 1e3, "p20_ms": t.p20_s * 1e3, "p80_ms": t.p80_s * 1e3,
                        "gb_s": gbs[k.label], "of_ceiling": frac.median, "of_ceiling_p20": frac.p20,
                        "of_ceiling_p80": frac.p80, "pairs": frac.pairs, **load})
    return list(leaders.values()), records


COLUMNS = ["kernel", "threads", "median_ms", "p20_ms", "p80_ms", "gb_s", "of_ceiling", "of_ceiling_p20",
           "of_ceiling_p80", "load"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mparams", type=float, default=64, help="values per array, in millions (2^20)")
    ap.add_argument("--threads", type=int, default=2, help="largest thread count tried")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    probe = Probe(int(args.mparams * 2**20), args.threads)
    try:
        leaders, records = measure(probe, rounds=args.rounds)
    finally:
        probe.close()
    print_table(records, COLUMNS, f"memory kernels over {args.mparams:g}M fp32 values (of_ceiling: per round, "
                                  f"GB/s / the fastest kernel's); fastest by median: {leaders[0].label}")
    write_json(args.json, "roofline", records, {"leaders": [k.label for k in leaders]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
