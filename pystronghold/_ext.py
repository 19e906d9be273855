"""Loading of the native extension `pystronghold._C`, with errors that say how to fix them.

Every module that needs native code calls `native()` instead of importing `_C` directly, so a
missing, broken or stale build is reported once, clearly, with the command that rebuilds it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path
from types import ModuleType

REBUILD_HINT = (
    "rebuild it with `make build` (or `pip install --no-build-isolation -e .` in the venv that "
    "has torch==2.13.0)"
)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


class ExtensionError(ImportError):
    """pystronghold._C is missing, does not load, or was built from other sources."""


def checkout_source_hash() -> str | None:
    """Hash of csrc/ as setup.py computes it, or None when running from an installed wheel."""
    if not _CSRC.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(_CSRC.rglob("*")):
        if path.suffix in (".cpp", ".h", ".cu", ".cuh"):
            digest.update(path.relative_to(_CSRC).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def native() -> ModuleType:
    """Return the loaded `pystronghold._C`; raise ExtensionError naming the fix otherwise."""
    try:
        _C = importlib.import_module("pystronghold._C")
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError)
        what = "is not built" if missing else f"failed to load ({exc})"
        raise ExtensionError(f"pystronghold's native extension pystronghold._C {what}; {REBUILD_HINT}.") from exc
    built = _C.build_info()["source_hash"]
    current = checkout_source_hash()
    if current is not None and current != built:
        raise ExtensionError(
            f"pystronghold._C is stale: it was built from csrc/ sources {built}, but the checkout "
            f"now holds {current}; {REBUILD_HINT}."
        )
    return _C
