"""Host-timed trace spans of what the block spans leave out.

The trace's compute, copy, update and wait spans cover the blocks. The rest of a training step is
named here, timed on the host clock (``time.monotonic()``), in three kinds:

- ``model``: the model's own code outside the streamed blocks, forward and backward (embedding,
  final norm, head, the loss when the model computes it, device-resident blocks, and the autograd
  and Function glue between two blocks): from ``Engine.__call__``/``Engine.backward`` entering the
  model, or a block call returning to it, to the next block call (or the end of the call);
- ``engine``: the engine's per-block calls (``PassExecutor.enter``/``leave``: loads issued, slot
  bound, gradient copy-out, host job submitted), the waits for copies and host updates they contain
  included (those are also "wait" spans);
- ``step``: the optimizer step (``Engine.run_step``: the host updates still running waited for,
  head/tail and resident device AdamW, global norm and clipping).

On the CPU backend, where compute is synchronous on the host, compute + model + engine + step plus
what runs outside the engine (the training loop's own code) is the step's wall time; on CUDA the
compute spans are device time and overlap these host spans.
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
