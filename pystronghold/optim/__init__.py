"""Every optimizer of pystronghold, and the one object their hyper-parameters travel in.

- ``AdamW``: the spec passed to ``pystronghold.wrap``; ``AdamWHyper``: one update's frozen values.
- ``WindowOptimizer``: ``engine.optimizer`` of a wrapped model (a ``torch.optim.Optimizer``).
- ``DeviceAdamW``: AdamW of the parameters on the device (head, tail, resident blocks).
- ``CPUAdam``: the fused CPU Adam/AdamW as a ``torch.optim.Optimizer``; ``adam_step_``,
  ``adam_step_multi_``, ``grad_sq_norm``: its functional form (the runtime's host updates);
  ``param_grad_norms``: per-parameter gradient norms as ``clip_grad_norm_`` takes them.
"""

from .cpu_adam import CPUAdam
from .device_adamw import DeviceAdamW
from .functional import adam_step_, adam_step_multi_, grad_sq_norm, param_grad_norms
from .hyper import AdamW, AdamWHyper, decay_groups
from .window_optimizer import WindowOptimizer

__all__ = ["AdamW", "AdamWHyper", "CPUAdam", "DeviceAdamW", "WindowOptimizer", "adam_step_", "adam_step_multi_",
           "decay_groups", "grad_sq_norm", "param_grad_norms"]
