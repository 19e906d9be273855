"""Ctrl-C (SIGINT) and SIGTERM before a run starts: one line and status 128 + the signal's number.

``catch_start_up_signals()`` is the first thing the command line does, before torch is imported.
While it is in effect a signal raises ``Interrupted`` (a ``KeyboardInterrupt`` carrying the signal),
so the ``finally`` blocks of start-up remove what it made (the --nvme probe file, a checkpoint
directory's lock) and ``cli.main`` prints the one line. Inside an import the process leaves at once
instead (``os._exit``, after the line): an exception raised there can leave a half-imported module
behind (torch's numpy: the Ctrl-C was lost, or the run crashed later), and an import holds nothing of
ours to clean up. A run replaces these handlers with its own (``train.command.StopOnSignal``: finish
the step, save) and gives them back when it ends. Python's handlers return on leaving the ``with``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["Interrupted", "catch_start_up_signals", "start_up_message", "exit_status"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during start-up; ``signum`` is which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(e: KeyboardInterrupt) -> int:
    """The exit status of a process ended by ``e``: 128 + the signal's number (130 for Ctrl-C, also
    for a plain KeyboardInterrupt, 143 for SIGTERM)."""
    return 128 + getattr(e, "signum", signal.SIGINT)


def start_up_message(e: KeyboardInterrupt) -> str:
    """What the command says of ``e`` arriving before its run started (after ``{command}: ``)."""
    signum = getattr(e, "signum", signal.SIGINT)
    return "interrupted during start-up" if signum == signal.SIGINT else \
        f"terminated during start-up ({signal.Signals(signum).name})"


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def catch_start_up_signals(command: str, *, speak: bool = True):
    """Within ``with``: SIGINT and SIGTERM raise ``Interrupted``, or inside an import print
    ``{command}: {start_up_message}`` (when ``speak``: a torchrun rank other than 0 stays silent, as
    every rank gets the Ctrl-C) and leave with ``exit_status``. A SIGINT ignored by whoever started
    the process (a shell's background job) stays ignored. Outside the main thread: no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame) -> None:
        e = Interrupted(signum)
        if not _in_import(frame):
            raise e
        if speak:
            print(f"{command}: {start_up_message(e)}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_status(e))

    previous = {}
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
