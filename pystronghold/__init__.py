"""pystronghold: train models larger than accelerator memory.

Only a working window of transformer blocks lives on the accelerator; the rest sits in host memory
(and on NVMe); a fused CPU Adam updates each block while the accelerator runs backward.

``pystronghold.wrap``, ``pystronghold.AdamW``, ``pystronghold.from_pretrained`` and
``pystronghold.save_pretrained`` (fine-tune a Hugging Face model from a local directory and write it
back) are imported lazily, so ``import pystronghold``
stays cheap (no torch import).
"""

import importlib.abc
import os
import sys

# NOTE: must be set before torch loads OpenMP (import pystronghold before torch to benefit). The
# host Adam runs an OpenMP team on the runtime's update thread beside torch's own team; with both
# spinning in barriers on a small host, a 20 ms step of a tiny model took 3 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"


class _TorchBeforeExtension(importlib.abc.MetaPathFinder):
    """Imports torch just before ``pystronghold._C`` loads, whoever imports it first.

    NOTE: the extension links against torch's shared libraries (libc10.so, libtorch_cpu.so), which
    carry no path the dynamic loader searches: they are found only once ``import torch`` has loaded
    them. Importing torch here, rather than at the top of this file, keeps ``import pystronghold``
    cheap while ``python -c "import pystronghold._C"`` works in a fresh process.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname == f"{__name__}._C":
            import torch  # noqa: F401

        return None  # the ordinary finders locate the extension itself


if not any(isinstance(f, _TorchBeforeExtension) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchBeforeExtension())

__all__ = ["wrap", "AdamW", "DivergenceError", "from_pretrained", "save_pretrained", "replicate", "split",
           "stage", "pipeline", "plan", "auto_plan", "__version__"]

_STRATEGY = {"replicate", "split", "stage", "pipeline", "annotate", "set_default_strategy", "layout_of"}


def __getattr__(name: str):
    if name in ("wrap", "from_pretrained"):
        from pystronghold.runtime import api

        return getattr(api, name)
    if name == "AdamW":
        from pystronghold.optim.hyper import AdamW

        return AdamW
    if name == "DivergenceError":
        from pystronghold.runtime.optimizer.divergence import DivergenceError

        return DivergenceError
    if name == "save_pretrained":
        from pystronghold.train.export_hf import save_pretrained

        return save_pretrained
    if name in _STRATEGY:  # Whale's scopes (pystronghold/strategy/)
        import pystronghold.strategy as strategy

        return getattr(strategy, name)
    if name in ("plan", "auto_plan"):
        from pystronghold.planner import hetero

        return getattr(hetero, name)
    raise AttributeError(f"module 'pystronghold' has no attribute {name!r}")
