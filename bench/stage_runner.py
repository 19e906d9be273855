"""Stages under timeouts, into one report: the machinery of bench/gpu_verify.py.

A stage is a list of commands run one after the other in their own process groups, each killed
(with whatever it started) when the stage's time is up; its outcome (pass, fail, timeout, skipped),
figures, targets and first error lines go into ``REPORT.md`` and ``report.json``, rewritten after
every stage so that a run cut short still leaves what ran.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
LOG_LIMIT_BYTES = 15 << 20
"""log.txt is cut beyond this: the device tool brings back files of at most 16 MiB."""
ERROR_LINES = 12
"""First error lines kept per stage in the report."""
ERROR_PATTERN = re.compile(r"Error|error:|FAILED|Traceback|Segmentation|core dumped|Killed|!!!|No such|not found")


# ---- running one command

@dataclass(slots=True)
class Command:
    """One process of a stage."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to the driver's environment."""
    label: str = ""


@dataclass(slots=True)
class CommandRun:
    label: str
    argv: list[str]
    rc: int | None
    """Exit status; None when it was killed at the stage's timeout; negative: killed by that signal."""
    seconds: float
    max_rss_bytes: int
    """Peak resident set of the process (its largest descendant's, as getrusage reports), bytes."""
    output: str = ""


def run_command(cmd: Command, timeout_s: float, log) -> CommandRun:
    """Run ``cmd`` in its own process group; its output (stdout and stderr) goes to ``log`` and is kept.
    Past ``timeout_s`` the whole group gets SIGTERM, then SIGKILL 10 s later."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **cmd.env}
    label = cmd.label or " ".join(cmd.argv)
    log.write(f"\n$ {label}\n")
    log.flush()
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        text = f"cannot start {cmd.argv[0]}: {exc}"
        log.write(text + "\n")
        return CommandRun(label, cmd.argv, 127, 0.0, 0, text)
    chunks: list[str] = []

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            chunks.append(line)
            if log.tell() < LOG_LIMIT_BYTES:
                log.write(line)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline, status, usage, killed = start + timeout_s, None, None, False
    while status is None:
        pid, wait_status, wait_usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            status, usage = wait_status, wait_usage
            break
        if time.perf_counter() > deadline and not killed:
            killed = True
            _signal_group(proc.pid, signal.SIGTERM)
            deadline += 10.0
        elif killed and time.perf_counter() > deadline:
            _signal_group(proc.pid, signal.SIGKILL)
            deadline += 3600.0
        time.sleep(0.2)
    _signal_group(proc.pid, signal.SIGKILL)  # what the command left behind holds the pipe open
    reader.join(timeout=10)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    rc = None if killed else proc.returncode
    if killed:
        chunks.append(f"!!! killed after {timeout_s:.0f} s (the stage's timeout)\n")
        log.write(chunks[-1])
    log.flush()
    return CommandRun(label, cmd.argv, rc, seconds, usage.ru_maxrss * 1024, "".join(chunks))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- stages and their results

@dataclass(slots=True)
class Target:
    """One of the issue's targets, judged by a figure of this run."""

    name: str
    measured: str
    goal: str
    met: bool | None
    """None: not measured (the stage failed, or the figure is not in this run)."""


@dataclass(slots=True)
class StageResult:
    name: str
    what: str
    status: str
    """'pass', 'fail', 'timeout', 'skipped'."""
    seconds: float = 0.0
    timeout_s: float = 0.0
    figures: list[str] = field(default_factory=list)
    """Lines for the report: what the stage measured."""
    targets: list[Target] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """First error lines of the output."""
    commands: list[dict] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    """Machine-readable figures (a benchmark's records)."""


@dataclass(slots=True)
class Context:
    dry: bool
    out: Path
    work: Path
    """Scratch: benchmark JSON, the NVMe tier, junit XML (not brought back)."""
    python: str
    results: list = field(default_factory=list)
    """The stages' results so far (a stage may judge a target against an earlier one's figures)."""
    time_left_s: float = 0.0
    """The timeout of the stage being set up, seconds (a stage may size its work to it)."""


@dataclass(slots=True)
class Stage:
    name: str
    what: str
    timeout_s: float
    """On the GPU; the dry run gives each stage ``dry_timeout_s``."""
    floor_s: float
    """Least time worth giving it: later stages' floors are held back from earlier ones' timeouts,
    and a stage with less than its floor left is skipped."""
    commands: Callable[[Context], list[Command]]
    summarize: Callable[[Context, StageResult, list[CommandRun]], None] | None = None
    dry_timeout_s: float = 300.0
    ok_rc: tuple[int, ...] = (0,)


def read_records(path: Path) -> dict:
    """A benchmark's JSON (``--json PATH``), or {} when the run wrote none."""
    return json.loads(path.read_text()) if path.exists() else {}


def first_errors(text: str, limit: int = ERROR_LINES) -> list[str]:
    """The pytest short summary when there is one, else the first lines that look like errors
    (with the last line of each traceback)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "short test summary info" in line:
            return [ln for ln in lines[i + 1:] if ln.strip() and not ln.startswith("=")][:limit]
    picked = [ln for ln in lines if ERROR_PATTERN.search(ln)]
    return [ln[:300] for ln in picked[:limit]] or [ln[:300] for ln in lines[-4:]]


def run_stage(stage: Stage, ctx: Context, timeout_s: float, log) -> StageResult:
    result = StageResult(stage.name, stage.what, "pass", timeout_s=timeout_s)
    log.write(f"\n======== stage {stage.name}: {stage.what} (timeout {timeout_s:.0f} s)\n")
    start = time.perf_counter()
    runs: list[CommandRun] = []
    ctx.time_left_s = timeout_s
    try:
        commands = stage.commands(ctx)
    except Exception as exc:  # noqa: BLE001 - a stage that cannot even be set up is reported, not fatal
        result.status, result.errors = "fail", [f"setting up the stage: {type(exc).__name__}: {exc}"]
        return result
    for cmd in commands:
        left = timeout_s - (time.perf_counter() - start)
        if left <= 1:
            result.status = "timeout"
            result.errors.append(f"no time left for: {cmd.label or ' '.join(cmd.argv)}")
            break
        run = run_command(cmd, left, log)
        runs.append(run)
        result.commands.append({"label": run.label, "rc": run.rc, "seconds": round(run.seconds, 2),
                                "max_rss_bytes": run.max_rss_bytes})
        if run.rc is None:
            result.status = "timeout"
            result.errors += [f"{run.label}: killed at the stage's timeout ({timeout_s:.0f} s)"]
            result.errors += first_errors(run.output)[:ERROR_LINES - 1]
        elif run.rc not in stage.ok_rc:
            result.status = "fail" if result.status == "pass" else result.status
            result.errors += [f"{run.label}: exit status {run.rc}"] + first_errors(run.output)
    if stage.summarize is not None:
        try:
            stage.summarize(ctx, result, runs)
        except Exception as exc:  # noqa: BLE001 - a missing figure must not hide the stage's status
            result.errors.append(f"summarizing: {type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - start
    result.errors = result.errors[:ERROR_LINES * 2]
    return result


# ---- the report

def write_report(ctx: Context, suite: str, results: list[StageResult], started: float, header: dict) -> None:
    status = "pass" if results and all(r.status in ("pass",) for r in results) else "fail"
    payload = {"suite": suite, "dry_run": ctx.dry, "status": status, **header,
               "seconds": round(time.time() - started, 1), "stages": [asdict(r) for r in results]}
    (ctx.out / "report.json").write_text(json.dumps(payload, indent=2, default=str))
    lines = [f"# GPU verification: {suite}{' (CPU dry run)' if ctx.dry else ''}", "",
             f"- commit {header.get('commit')}, {header.get('date')}, host {header.get('host')}",
             f"- device: {header.get('device')}",
             f"- {sum(r.status == 'pass' for r in results)} of {len(results)} stages passed, "
             f"{time.time() - started:.0f} s in all", "",
             "| stage | status | time s | what |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status.upper() if r.status != 'pass' else 'pass'} | {r.seconds:.1f} | {r.what} |"
              for r in results]
    targets = [t for r in results for t in r.targets]
    if targets:
        lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        lines += [f"| {t.name} | {t.measured} | {t.goal} | "
                  f"{'-' if t.met is None else 'yes' if t.met else 'NO'} |" for t in targets]
    for r in results:
        lines += ["", f"## {r.name}: {r.status} ({r.seconds:.1f} s of {r.timeout_s:.0f})", ""]
        lines += [f"- {f}" for f in r.figures]
        if r.errors:
            lines += ["", "```", *r.errors, "```"]
    (ctx.out / "REPORT.md").write_text("\n".join(lines) + "\n")


def run_suite(suite: str, stages: list[Stage], ctx: Context, budget_s: float, device: str,
              commit: str | None = None) -> int:
    """Run ``stages`` within ``budget_s`` seconds (the dry run: each its ``dry_timeout_s``); 0 when
    every stage passed. ``device``: the machine's accelerator, in words, for the report."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    header = {"commit": commit or _git("rev-parse", "--short=12", "HEAD"), "dirty": bool(_git("status", "--porcelain")),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": os.uname().nodename, "device": device}
    started, t0 = time.time(), time.perf_counter()  # NOTE: the budget is the stages' (git is not timed)
    results: list[StageResult] = []
    with open(ctx.out / "log.txt", "w", encoding="utf-8", errors="replace") as log:
        for i, stage in enumerate(stages):
            if ctx.dry:
                timeout = stage.dry_timeout_s
            else:
                left = budget_s - (time.perf_counter() - t0)
                held_back = sum(s.floor_s for s in stages[i + 1:])
                timeout = min(stage.timeout_s, left - held_back)
                if timeout < stage.floor_s:
                    timeout = stage.floor_s if left >= stage.floor_s else 0.0
            if timeout <= 0:
                result = StageResult(stage.name, stage.what, "skipped",
                                     errors=[f"the suite's budget ({budget_s:.0f} s) is spent"])
            else:
                print(f"gpu-verify: stage {stage.name} (timeout {timeout:.0f} s) ...", flush=True)
                result = run_stage(stage, ctx, timeout, log)
            print(f"gpu-verify: stage {stage.name}: {result.status} in {result.seconds:.1f} s"
                  + "".join(f"\n    {f}" for f in result.figures)
                  + "".join(f"\n  ! {e}" for e in result.errors[:6]), flush=True)
            results.append(result)
            ctx.results.append(result)
            write_report(ctx, suite, results, started, header)
    print((ctx.out / "REPORT.md").read_text())
    return 0 if all(r.status == "pass" for r in results) else 1


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
