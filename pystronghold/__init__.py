"""pystronghold: train models larger than accelerator memory.

Only a working window of transformer blocks lives on the accelerator; the rest sits in host memory
(and on NVMe); a fused CPU Adam updates each block while the accelerator runs backward.

``pystronghold.wrap`` and ``pystronghold.AdamW`` are imported lazily, so ``import pystronghold``
stays cheap (no torch import).
"""

__version__ = "0.1.0"

__all__ = ["wrap", "AdamW", "__version__"]


def __getattr__(name: str):
    if name == "wrap":
        from pystronghold.runtime.api import wrap

        return wrap
    if name == "AdamW":
        from pystronghold.runtime.optimizer import AdamW

        return AdamW
    raise AttributeError(f"module 'pystronghold' has no attribute {name!r}")
