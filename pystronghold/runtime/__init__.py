"""The layer-window runtime, in rooms along its import graph (lowest first; a room imports only
from its own floor and those below: tests/package/test_package_floors.py ``RUNTIME_FLOORS``):

- ``memory`` (byte layout, placement, the NVMe tier, the host store), ``tracing``, ``blocks``
  (into the model: discovery, purity, the per-block autograd Function, side outputs, inputs),
  ``states`` (state dicts);
- ``backends`` (CPU/CUDA), ``optimizer`` (the step, host updates, resident and head/tail Adam,
  gradient norms, the fp16 loss scale, divergence), ``streaming`` (window, schedule, pass executor,
  saved inputs, relay, layer drop);
- here: ``RuntimeConfig`` (``config``: what ``wrap`` accepts; no room imports it, each is handed
  the values it uses), the ``Engine``, its build and wrap-time checks, the memory report, ``wrap``
  (``api``). Compute precision is ``pystronghold.settings.precision``, shared with the commands.
"""
