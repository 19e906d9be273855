"""Where the trace's times come from: host readings on the CPU backend, CUDA events on the GPU.

A timed action is two marks, start and end: a host reading (``time.monotonic()`` seconds) or a
device mark (a timing event on the stream that does the work). Device marks are placed on the host
timeline by one calibration per step (an event waited for at a sync point, with the host time the
wait returned), so a span's duration is the device's ``elapsed_time``. The backends' ``clock``
(``HostClock`` or ``EventClock``) makes marks; ``trace.Tracer.resolve`` places them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Calibration", "HostClock", "EventClock", "is_host_mark", "mark_done", "to_host_s",
           "copy_marks"]


@dataclass(frozen=True, slots=True)
class Calibration:
    """One device event and the host time it was seen complete: the anchor of a step's device marks."""

    event: object
    """The reference device mark (recorded on the compute stream, complete)."""
    host_s: float
    """Host seconds (``time.monotonic()``) read as soon as ``event`` was waited for."""


def is_host_mark(mark) -> bool:
    """True for a host reading (a float), False for a device event."""
    return isinstance(mark, float)


def mark_done(mark) -> bool:
    """True when the point ``mark`` stands for has happened (host readings always have)."""
    return True if is_host_mark(mark) else bool(mark.query())


def to_host_s(mark, calibration: Calibration | None) -> float:
    """``mark`` in host seconds. A device mark needs ``calibration`` (recorded after it) and must be done.

    Raises ValueError for a device mark without a calibration.
    """
    if is_host_mark(mark):
        return mark
    if calibration is None:
        raise ValueError("to_host_s: a device mark needs a calibration (none was given)")
    # elapsed_time(a, b) is b - a in milliseconds; the reference is recorded after every mark it places
    return calibration.host_s - mark.elapsed_time(calibration.event) / 1e3


def copy_marks(handle) -> tuple | None:
    """(start, end) marks of a finished copy handle: its device marks where it has them
    (``start_mark``/``end_mark``, timed CUDA copies), else its host stamps (``start_s``/``end_s``,
    copy-engine requests, which the worker that ran them stamped); None for a CUDA copy issued
    untimed (the trace was off)."""
    if getattr(handle, "end_mark", None) is not None:
        return handle.start_mark, handle.end_mark
    if not hasattr(handle, "start_s"):
        return None
    return float(handle.start_s), float(handle.end_s)


class HostClock:
    """Marks are host readings: the clock of the CPU backend (compute runs on the host)."""

    def mark(self, stream=None) -> float:
        """Now, seconds on ``time.monotonic()`` (``stream`` is ignored)."""
        return time.monotonic()

    def calibrate(self) -> Calibration | None:
        """Nothing to calibrate: host marks are already on the host timeline."""
        return None


class EventClock:
    """Marks are timing events recorded on a stream (the CUDA backend's clock).

    ``new_event()`` makes an event with timing enabled (``torch.cuda.Event(enable_timing=True)``);
    ``current_stream()`` is the stream compute is issued on; ``host_now`` the host clock. Passing
    them in keeps the placement logic testable without a GPU.
    """

    def __init__(self, new_event: Callable[[], object], current_stream: Callable[[], object],
                 host_now: Callable[[], float] = time.monotonic) -> None:
        self._new_event, self._current_stream, self._host_now = new_event, current_stream, host_now

    def mark(self, stream=None):
        """A timing event recorded now on ``stream`` (default: the current compute stream)."""
        event = self._new_event()
        event.record(self._current_stream() if stream is None else stream)
        return event

    def calibrate(self) -> Calibration:
        """Record a reference on the compute stream, wait for it, read the host clock.

        NOTE: this makes the host wait for the compute issued so far (one event, not the whole
        device). The host reading follows the device timestamp by the wake-up latency of the wait
        (microseconds), which is the error of every placed mark; durations have none.
        """
        event = self.mark()
        event.synchronize()
        return Calibration(event, self._host_now())
