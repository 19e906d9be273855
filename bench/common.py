"""Shared helpers of the benchmark scripts: paired timing, machine load, machine facts, tables, JSON,
the trainers that plain PyTorch and pystronghold.wrap are timed through.

Every comparison here is *paired*: the configurations compared take turns, A B A B ... (``interleave``),
and a ratio is the median of the per-round ratios with its p20-p80 spread (``paired_ratio``), never a
ratio of two medians taken at different moments, which on a shared machine mostly measures how the
load moved in between. Each record also carries the machine's load at its start and end
(``LoadWatch``); a load above the core count marks the figure as taken on a loaded machine.
Nothing here asserts a time.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent

MIN_PAIRS = 10
"""Fewest timed rounds (pairs) a paired comparison accepts."""


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``: the element at rank ``int(q * n)`` of the sorted values."""
    if not values:
        raise ValueError("quantile: values is empty")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Timing:
    """Seconds per call over `reps` timed repetitions (after warm-up)."""

    median_s: float
    p20_s: float
    p80_s: float
    reps: int
    samples_s: list = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, samples_s: Sequence[float]) -> "Timing":
        """Median and p20/p80 of ``samples_s`` (seconds), samples kept in the order taken."""
        return cls(statistics.median(samples_s), quantile(samples_s, 0.2), quantile(samples_s, 0.8),
                   len(samples_s), list(samples_s))


@dataclass
class Ratio:
    """A paired ratio baseline time / candidate time (> 1: the candidate is faster): the median of the
    per-round ratios and their p20 and p80, over `pairs` rounds."""

    median: float
    p20: float
    p80: float
    pairs: int

    @classmethod
    def of(cls, ratios: Sequence[float]) -> "Ratio":
        """Median, p20 and p80 of per-round ratios (at least MIN_PAIRS of them)."""
        if len(ratios) < MIN_PAIRS:
            raise ValueError(f"Ratio.of: {len(ratios)} pairs; at least {MIN_PAIRS} are needed")
        return cls(statistics.median(ratios), quantile(ratios, 0.2), quantile(ratios, 0.8), len(ratios))

    def label(self, digits: int = 2) -> str:
        """``1.23 (1.10-1.31)``: median and p20-p80."""
        return f"{self.median:.{digits}f} ({self.p20:.{digits}f}-{self.p80:.{digits}f})"

    def scaled(self, factor: float) -> "Ratio":
        """The same ratio times a constant (e.g. bytes moved by the candidate / by the baseline)."""
        return Ratio(self.median * factor, self.p20 * factor, self.p80 * factor, self.pairs)


def time_call(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20, min_time_s: float = 0.0) -> Timing:
    """Time `fn()` alone after `warmup` untimed calls: at least `reps` calls and at least `min_time_s`
    seconds. For a single figure only; configurations that are compared go through ``interleave``."""
    for _ in range(warmup):
        fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing.of(samples)


def interleave(fns: Mapping[str, Callable[[], object]], *, rounds: int = MIN_PAIRS, warmup: int = 2,
               min_time_s: float = 0.0, sync: Callable[[], object] | None = None,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time every function of ``fns`` taking turns, A B C A B C ...: ``warmup`` untimed rounds, then
    at least ``rounds`` (>= MIN_PAIRS) timed rounds and at least ``min_time_s`` seconds. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs after each call, inside its time. Returns name -> Timing whose
    samples line up round by round, as ``paired_ratio`` needs."""
    if not fns:
        raise ValueError("interleave: fns is empty")
    if rounds < MIN_PAIRS:
        raise ValueError(f"interleave: rounds={rounds}; a paired comparison needs at least {MIN_PAIRS}")
    if warmup < 0:
        raise ValueError(f"interleave: warmup={warmup} must be >= 0")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    start, done = clock(), 0
    while done < warmup + rounds or clock() - start < min_time_s:
        for name, fn in fns.items():
            t0 = clock()
            fn()
            if sync is not None:
                sync()
            if done >= warmup:
                samples[name].append(clock() - t0)
        if done == warmup - 1:
            start = clock()
        done += 1
    return {name: Timing.of(s) for name, s in samples.items()}


def paired_ratio(baseline: Timing | Sequence[float], candidate: Timing | Sequence[float]) -> Ratio:
    """Median and p20-p80 of baseline[i] / candidate[i] over the rounds i (> 1: candidate faster).
    Both must come from the same ``interleave`` (or the same turn-taking loop): equal lengths."""
    b = baseline.samples_s if isinstance(baseline, Timing) else list(baseline)
    c = candidate.samples_s if isinstance(candidate, Timing) else list(candidate)
    if len(b) != len(c):
        raise ValueError(f"paired_ratio: {len(b)} baseline samples but {len(c)} candidate samples; "
                         "pairs must come from the same rounds")
    if len(b) < MIN_PAIRS:
        raise ValueError(f"paired_ratio: {len(b)} pairs; at least {MIN_PAIRS} are needed")
    if any(x <= 0 for x in (*b, *c)):
        raise ValueError("paired_ratio: every time must be > 0 seconds")
    return Ratio.of([x / y for x, y in zip(b, c)])


# ---- machine load


def read_load(path: str | os.PathLike = "/proc/loadavg") -> float:
    """The 1-minute load average (runnable + uninterruptible tasks), from ``/proc/loadavg``."""
    try:
        return float(Path(path).read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return os.getloadavg()[0]


@dataclass
class Load:
    """The 1-minute load average at a measurement's start and end, and the machine's core count.
    ``loaded``: either exceeds the core count, so other work competed for the cores."""

    start: float
    end: float
    cores: int

    @property
    def loaded(self) -> bool:
        return max(self.start, self.end) > self.cores

    def label(self) -> str:
        """``0.4-1.2`` or ``3.1-4.0 LOADED``."""
        return f"{self.start:.1f}-{self.end:.1f}" + (" LOADED" if self.loaded else "")

    def fields(self) -> dict:
        """The record fields: load_start, load_end, loaded, load (the label)."""
        return {"load_start": self.start, "load_end": self.end, "loaded": self.loaded, "load": self.label()}


class LoadWatch:
    """Reads the load now; ``stop()`` reads it again and returns the ``Load`` of the interval.
    ``reader`` (default ``read_load``) and ``cores`` (default ``os.cpu_count()``) can be replaced."""

    def __init__(self, reader: Callable[[], float] = read_load, cores: int | None = None) -> None:
        self.reader, self.cores = reader, cores or os.cpu_count() or 1
        self.start = reader()

    def stop(self) -> Load:
        return Load(self.start, self.reader(), self.cores)


def any_loaded(records: Sequence[dict]) -> bool:
    """True when a record was marked loaded."""
    return any(r.get("loaded") for r in records)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_facts() -> dict:
    """CPU model, SIMD level of the build, threads, versions, commit, time and load, for JSON records."""
    import torch

    facts = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "commit": git_commit(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "load_at_write": read_load(),
    }
    try:
        from pystronghold._ext import native

        build = native().build_info()
        facts.update(simd=build["simd"], openmp_threads=build["openmp_max_threads"])
    except ImportError:
        facts.update(simd="unbuilt")
    return facts


def print_table(rows: list[dict], columns: list[str], title: str = "") -> None:
    """Print `rows` (dicts) as an aligned text table with the given column order."""
    if title:
        print(f"\n{title}")
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    if any_loaded(rows):
        print(f"rows marked LOADED: the load average exceeded the {os.cpu_count()} cores during them "
              "(other work competed); their figures are not those of a quiet machine")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | os.PathLike | None, subject: str, records: list, extra: dict | None = None) -> None:
    """Write `records` with the machine facts to `path` (no-op when path is None)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"subject": subject, "machine": machine_facts(), **(extra or {}),
               "records": [asdict(r) if hasattr(r, "__dataclass_fields__") else r for r in records]}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


def add_gpt_arguments(parser, *, layers: int, hidden: int, seq: int, steps: int, warmup: int) -> None:
    """The GPT shape and timing options the training benchmarks share (their defaults differ)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=warmup)


def token_batches(vocab_size: int, batch: int, seq: int, count: int, seed: int = 0) -> list:
    """``count`` (input, target) pairs of random token ids, each (batch, seq) int64, from ``seed``:
    the same data for every configuration a training benchmark compares."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab_size, (batch, seq), generator=g),
             torch.randint(0, vocab_size, (batch, seq), generator=g)) for _ in range(count)]


def hf_llama(layers: int, hidden: int, *, positions: int = 256, vocab: int = 512, seed: int = 0):
    """A Hugging Face Llama from a small config (nothing downloaded): FFN 4 x hidden, heads of 64,
    ``vocab`` tokens, weights from ``seed``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                                   num_attention_heads=max(1, hidden // 64), vocab_size=vocab,
                                   max_position_embeddings=positions)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)



# ---- trainers: the training step every contender is timed on


class TorchTrainer:
    """Plain PyTorch with a torch optimizer. One step: ``loss(*batch)`` inside ``autocast()`` (a
    context-manager factory; default none), backward, ``torch.nn.utils.clip_grad_norm_`` to ``clip``
    (None: no clipping), ``opt.step()``, ``opt.zero_grad()``; returns the loss as a float."""

    def __init__(self, model, opt, *, clip: float | None = None, autocast=contextlib.nullcontext) -> None:
        self.model, self.opt, self.clip, self.autocast = model, opt, clip, autocast

    def loss(self, *batch):
        return self.model(*batch)

    def step(self, *batch) -> float:
        with self.autocast():
            loss = self.loss(*batch)
        loss.backward()
        if self.clip is not None:
            import torch

            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def close(self) -> None:
        pass


class WrappedTrainer:
    """The same training through a ``pystronghold.wrap`` engine. One step: ``loss(*batch)``,
    ``engine.backward``, ``engine.step()``, ``engine.zero_grad()``; returns the loss as a float."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def loss(self, *batch):
        return self.engine(*batch)

    def step(self, *batch) -> float:
        loss = self.loss(*batch)
        self.engine.backward(loss)
        self.engine.step()
        self.engine.zero_grad()
        return loss.item()

    def close(self) -> None:
        self.engine.close()


# ---- host memory

def reset_host_peak() -> bool:
    """Reset the process's peak RSS (VmHWM); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def host_peak_bytes() -> int:
    """The process's peak resident set (VmHWM), bytes; 0 where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
