"""Optional dependencies and the pip extras that install them.

The package runs with its ``install_requires`` alone (torch, numpy, safetensors, tqdm); a few
options need more. Each option checks its extra when it is parsed (``require``), so a missing
package fails the command at once with the line to install it, not after training.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "missing", "require"]

EXTRAS = {
    "plots": ("matplotlib",),
    "kernels": ("triton",),
    "hf": ("transformers", "tokenizers"),
    "yaml": ("yaml",),
    "peft": ("peft",),
    "data": ("datasets",),
}
"""pip extra -> the importable modules it provides (setup.py's ``extras_require`` installs them)."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` (a key of ``EXTRAS``) that cannot be imported here."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}, got {extra!r}")
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]


def require(extra: str, needed_by: str) -> None:
    """Raise ``ImportError`` naming ``needed_by`` (e.g. ``"--trace"``) and the pip line to run when a
    module of ``extra`` is not installed."""
    absent = missing(extra)
    if absent:
        raise ImportError(f"{needed_by} needs {' and '.join(absent)}, which is not installed: "
                          f"pip install 'pystronghold[{extra}]'")
