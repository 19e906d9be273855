"""Copy engine and file tier bandwidth, each against a baseline measured in the same run.

Host to host: CopyEngine.copy (1 and 2 threads) against one plain memcpy (native probe, GIL
released) and torch.Tensor.copy_, at 64 MiB and 512 MiB.
File tier: FileStore write/read of records of 16 MiB and 64 MiB against `dd` with
oflag=direct / iflag=direct on the same directory (same bytes per repetition, block size = record
size).
Every method takes turns with its baseline (A B A B ..., bench/common.py); ratio = the median of the
per-round ratios baseline time / method time, with its p20-p80; each row carries the load.

With --device cuda (instead of the two above): host<->device at 64 MiB and 512 MiB, H2D and D2H,
of the runtime's copies (CopyEngine from a pinned HostArena and from pageable memory, staged
through its pinned buffer; the CUDA backend's window loads) against torch's own pinned copy
(`dst.copy_(src_pinned, non_blocking=True)` + synchronize: the link's ceiling, same run), and what
pinning costs: HostArena(pin="cuda") built and released (mmap + cudaHostRegister, which faults every
page in) per GiB, against the same arena unpinned with every page touched once.

    .venv/bin/python bench/copy_engine.py [--dir /path/on/nvme] [--quick] [--json bench/results/copy.json]
    .venv/bin/python bench/copy_engine.py --device cuda [--quick] [--json bench/results/copy_cuda.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LoadWatch, interleave, paired_ratio, print_table, time_call, write_json  # noqa: E402

from pystronghold._ext import native  # noqa: E402
from pystronghold.io import CopyEngine, FileStore, HostArena  # noqa: E402

MiB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ---- host to host

def bench_host(sizes_mib: list[int], reps: int) -> list[dict]:
    rows = []
    for size_mib in sizes_mib:
        n = size_mib * MiB
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)  # touched: no page faults in the timings
        candidates = {"memcpy (baseline)": lambda: native().memcpy_probe(dst, src),
                      "torch copy_": lambda: dst.copy_(src)}
        engines = {t: CopyEngine(threads=t, queues=1) for t in (1, 2)}
        for t, eng in engines.items():
            candidates[f"engine {t} thread{'s' if t > 1 else ''}"] = lambda eng=eng: eng.copy(dst, src).wait()
        for name, fn in candidates.items():
            dst.zero_()
            fn()
            assert torch.equal(dst, src), name  # correct before timed
        watch = LoadWatch()
        times = interleave(candidates, rounds=reps)
        load = watch.stop().fields()
        base = times["memcpy (baseline)"]
        for name, t in times.items():
            r = paired_ratio(base, t)
            rows.append(dict(kind="host->host", size_mib=size_mib, method=name, median_ms=t.median_s * 1e3,
                             p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3, gb_s=gbps(n, t.median_s),
                             ratio=r.median, ratio_p20=r.p20, ratio_p80=r.p80, **load))
        for eng in engines.values():
            eng.close()
        del src, dst
    return rows


# ---- host <-> device (CUDA)

def cuda_unavailable_reason() -> str | None:
    """Why --device cuda cannot run here (one line), or None."""
    if not torch.cuda.is_available():
        return f"no usable CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    if not native().build_info()["with_cuda"]:
        return ("pystronghold._C was built without CUDA: rebuild with PYSTRONGHOLD_CUDA=1 "
                "(make gpu-test does)")
    return None


def synced(fn):
    """fn() then a device synchronize: wall time covers the copy, not just its issue."""
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def bench_device(sizes_mib: list[int], reps: int) -> list[dict]:
    from pystronghold.runtime.backends.backend_cuda import CUDABackend

    rows = []
    engine = CopyEngine(threads=2, queues=2)
    for size_mib in sizes_mib:
        n = size_mib * MiB
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        torch_pinned = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
        pinned_arena = HostArena(n, pin="cuda")
        pinned = pinned_arena.allocate("buf", (n,), torch.uint8)
        pageable = torch.randint(0, 256, (n,), dtype=torch.uint8)
        backend = CUDABackend("cuda", 256)
        pinned.copy_(torch_pinned)
        for direction in ("h2d", "d2h"):
            def copy_between(host, direction=direction):
                pair = (dev, host) if direction == "h2d" else (host, dev)
                return lambda: engine.copy(*pair).wait()

            def torch_copy(host, direction=direction):
                def run():
                    if direction == "h2d":
                        dev.copy_(host, non_blocking=True)
                    else:
                        host.copy_(dev, non_blocking=True)
                return run

            backend_copy = (lambda: backend.h2d(dev, pinned).wait()) if direction == "h2d" else \
                (lambda: backend.d2h(pinned, dev).wait())
            window_name = ("CUDABackend.h2d (window load)" if direction == "h2d"
                           else "CUDABackend.d2h (gradient copy-out)")
            # name -> (copy, the host buffer it reads or writes)
            candidates = {"CopyEngine, pinned HostArena": (copy_between(pinned), pinned),
                          "CopyEngine, pageable (staged)": (copy_between(pageable), pageable),
                          f"{window_name}, pinned HostArena": (backend_copy, pinned),
                          "torch copy_, pageable": (torch_copy(pageable), pageable)}
            base = time_call(synced(torch_copy(torch_pinned)), reps=reps)
            rows.append(dict(kind=direction, size_mib=size_mib, method="torch copy_, pinned (baseline)",
                             median_ms=base.median_s * 1e3, p20_ms=base.p20_s * 1e3, p80_ms=base.p80_s * 1e3,
                             gb_s=gbps(n, base.median_s), ratio=1.0))
            for name, (fn, host) in candidates.items():
                if direction == "h2d":
                    dev.fill_(7)
                else:
                    dev.copy_(torch_pinned)
                    host.zero_()
                synced(fn)()
                assert torch.equal(dev.cpu(), host), name  # correct before timed
                t = time_call(synced(fn), reps=reps)
                rows.append(dict(kind=direction, size_mib=size_mib, method=name, median_ms=t.median_s * 1e3,
                                 p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3, gb_s=gbps(n, t.median_s),
                                 ratio=base.median_s / t.median_s))
        backend.close()
        del dev, torch_pinned, pinned, pinned_arena, pageable
    engine.close()
    return rows


def bench_pinning(size_mib: int, reps: int) -> list[dict]:
    """Seconds per GiB to build and release a pinned arena (mmap, cudaHostRegister, which faults every
    page in; cudaHostUnregister, munmap), against an unpinned one whose pages are touched once."""
    n = size_mib * MiB
    gib = n / (1 << 30)

    def pinned():
        arena = HostArena(n, pin="cuda")
        assert arena.pinned, arena.pin_warning
        del arena  # cudaHostUnregister + munmap inside the sample, as the touched baseline's munmap

    def touched():
        arena = HostArena(n, pin="none")
        arena.allocate("all", (n,), torch.uint8).fill_(0)
        del arena

    base = time_call(touched, warmup=1, reps=reps)
    t = time_call(pinned, warmup=1, reps=reps)
    return [dict(kind="pin", size_mib=size_mib, method="HostArena(pin='none') + touch every page (baseline)",
                 median_ms=base.median_s * 1e3, p20_ms=base.p20_s * 1e3, p80_ms=base.p80_s * 1e3,
                 s_per_gib=base.median_s / gib, ratio=1.0),
            dict(kind="pin", size_mib=size_mib, method="HostArena(pin='cuda'): cudaHostRegister",
                 median_ms=t.median_s * 1e3, p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3,
                 s_per_gib=t.median_s / gib, ratio=base.median_s / t.median_s)]


# ---- file tier against dd

def run_dd(args: list[str]) -> None:
    done = subprocess.run(["dd", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {done.stderr.strip()}")


def bench_files(directory: Path, record_mib: list[int], total_mib: int, reps: int) -> list[dict]:
    rows = []
    engine = CopyEngine(threads=2, queues=4)
    for rec_mib in record_mib:
        n = rec_mib * MiB
        count = max(1, total_mib // rec_mib)
        total = n * count
        work = directory / f"rec{rec_mib}"
        shutil.rmtree(work, ignore_errors=True)
        arena = HostArena(2 * total + MiB)
        srcs = [arena.allocate(f"src{i}", (n,), torch.uint8) for i in range(count)]
        dsts = [arena.allocate(f"dst{i}", (n,), torch.uint8) for i in range(count)]
        for s in srcs:
            s.random_(0, 256)
        store = FileStore.create(work, num_blocks=count, record_bytes={"m": n}, engine=engine)

        def write_all():
            for h in [store.write(i, "m", s, queue=i % 4) for i, s in enumerate(srcs)]:
                h.wait()

        def read_all():
            for h in [store.read(i, "m", d, queue=i % 4) for i, d in enumerate(dsts)]:
                h.wait()

        write_all()
        read_all()
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))  # correct before timed
        raw = work / "dd.bin"
        dd_common = [f"bs={n}", f"count={count}"]
        dd_write = ["if=/dev/zero", f"of={raw}", "oflag=direct", "conv=notrunc", *dd_common]
        dd_read = [f"if={raw}", "of=/dev/null", "iflag=direct", *dd_common]
        run_dd(dd_write)
        for op, candidate, baseline in (("write", write_all, dd_write), ("read", read_all, dd_read)):
            watch = LoadWatch()
            times = interleave({"dd": lambda baseline=baseline: run_dd(baseline), "store": candidate},
                               rounds=reps, warmup=1)
            load = watch.stop().fields()
            base, t = times["dd"], times["store"]
            r = paired_ratio(base, t)
            rows.append(dict(kind=f"file {op}", size_mib=rec_mib, method=f"dd {'o' if op == 'write' else 'i'}flag=direct "
                             "(baseline)", median_ms=base.median_s * 1e3, p20_ms=base.p20_s * 1e3,
                             p80_ms=base.p80_s * 1e3, gb_s=gbps(total, base.median_s), ratio=1.0, ratio_p20=1.0,
                             ratio_p80=1.0, **load))
            rows.append(dict(kind=f"file {op}", size_mib=rec_mib,
                             method=f"FileStore ({'O_DIRECT' if store.direct_io('m') else 'buffered'}, {count} records)",
                             median_ms=t.median_s * 1e3, p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3,
                             gb_s=gbps(total, t.median_s), ratio=r.median, ratio_p20=r.p20, ratio_p80=r.p80, **load))
        store.close()
        del store, srcs, dsts, arena
        shutil.rmtree(work, ignore_errors=True)
    engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="directory for the file tier (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="64 MiB host copies and 16 MiB records, 10 rounds")
    parser.add_argument("--json", default=None, help="write the records with the machine facts here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: host->host and file tier (default); cuda: host<->device and pinning")
    args = parser.parse_args()
    reps = 10 if args.quick else 20
    if args.device == "cuda":
        main_cuda(args, reps)
        return
    host_rows = bench_host([64] if args.quick else [64, 512], reps)
    columns = ["kind", "size_mib", "method", "median_ms", "p20_ms", "p80_ms", "gb_s", "ratio", "ratio_p20",
               "ratio_p80", "load"]
    print_table(host_rows, columns, "host to host (ratio = baseline time / method time, paired: median, p20, p80)")
    directory = args.dir or Path(tempfile.mkdtemp(prefix="ps-bench-", dir="/var/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        file_rows = bench_files(directory, [16] if args.quick else [16, 64], 128 if args.quick else 256,
                                10 if args.quick else 20)
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print_table(file_rows, columns, f"file tier in {directory} (ratio = dd time / FileStore time, paired)")
    write_json(args.json, "copy_engine", host_rows + file_rows, extra={"file_dir": str(directory)})


def main_cuda(args: argparse.Namespace, reps: int) -> None:
    why = cuda_unavailable_reason()
    if why is not None:
        sys.exit(f"bench/copy_engine.py --device cuda: {why}")
    columns = ["kind", "size_mib", "method", "median_ms", "p20_ms", "p80_ms", "gb_s", "ratio"]
    rows = bench_device([64] if args.quick else [64, 512], reps)
    print(f"device: {torch.cuda.get_device_name()}")
    print_table(rows, columns, "host <-> device (ratio = torch pinned copy time / method time)")
    pin_rows = bench_pinning(256 if args.quick else 1024, 3 if args.quick else 5)
    print_table(pin_rows, ["kind", "size_mib", "method", "median_ms", "p20_ms", "p80_ms", "s_per_gib", "ratio"],
                "pinning cost (ratio = baseline time / method time)")
    write_json(args.json, "copy_engine_cuda", rows + pin_rows,
               extra={"device": torch.cuda.get_device_name(), "load_avg": os.getloadavg()})


if __name__ == "__main__":
    main()
