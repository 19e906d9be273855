"""Host-timed trace spans of what the block spans leave out.

Three kinds, on ``time.monotonic()``: ``model`` (the model's own code outside the streamed blocks:
embedding, head, loss, resident blocks, autograd glue), ``engine`` (the engine's per-block calls,
their waits included) and ``step`` (``Engine.run_step``: device AdamW, norms, clipping, waiting
for host updates). On the CPU backend compute + model + engine + step plus the loop's own code is
the step's wall time; on CUDA compute spans are device time and overlap these.
"""

from __future__ import annotations

import time

__all__ = ["HostSpans", "HOST_KINDS"]

HOST_KINDS = ("model", "engine", "step")
"""Kinds recorded by ``HostSpans``."""


class HostSpans:
    """Records ``model``/``engine``/``step`` spans into ``tracer`` (nothing when it is disabled)."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self._model_since: float | None = None  # when control last went back to the model's code

    def model_resumes(self, now: float | None = None) -> None:
        """The model's own code runs from ``now`` (default: now) on."""
        self._model_since = time.monotonic() if now is None else now

    def model_pauses(self) -> float:
        """The model's code stops running now (a block call, or the end of a forward/backward):
        records its span since ``model_resumes``; returns now."""
        now = time.monotonic()
        if self._model_since is not None:
            self.tracer.record("model", None, self._model_since, now)
            self._model_since = None
        return now

    def engine(self, block: int, start_s: float) -> float:
        """Record an engine call of ``block`` from ``start_s`` to now; returns now."""
        now = time.monotonic()
        self.tracer.record("engine", block, start_s, now)
        return now
