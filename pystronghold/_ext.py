"""Loading of the native extension `pystronghold._C`, with errors that say how to fix them.

Every module that needs native code calls `native()` instead of importing `_C` directly, so a
missing, broken or stale build is reported once, clearly, with its cause and fix (the rebuild
command, or the torch that is missing or mismatched).
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


def load_failure_cause(exc: ImportError) -> str:
    """Why `pystronghold._C` did not load, and the fix, from the loader's error ``exc``.

    NOTE: the extension links against torch's shared libraries and symbols. A library that cannot
    be found means torch itself is missing or broken (rebuilding would not help); an undefined
    symbol means the extension was built against another torch than the one installed.
    """
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name == "pystronghold._C":
        return f"pystronghold._C is not built; {REBUILD_HINT}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch":
        return f"pystronghold._C needs torch, which does not import here ({text}); install torch in this environment"
    if text.startswith("PYSTRONGHOLD_SIMD_FORCE="):  # the variable names a variant this CPU cannot run
        return text.rstrip(".")
    if "cannot open shared object file" in text:
        library = text.split(":", 1)[0].strip()
        try:
            import torch
        except ImportError as torch_exc:
            return (f"pystronghold._C failed to load: it needs torch's library {library}, and torch "
                    f"does not import here ({torch_exc}); install torch in this environment")
        return (f"pystronghold._C failed to load ({text}); torch {torch.__version__} imports from "
                f"{Path(torch.__file__).parent} but does not provide it: the extension was built "
                f"against another torch; {REBUILD_HINT}")
    if "undefined symbol" in text:
        import torch

        return (f"pystronghold._C failed to load ({text}): it was built against another torch than "
                f"the installed {torch.__version__}; {REBUILD_HINT}")
    return f"pystronghold._C failed to load ({text}); {REBUILD_HINT}"


@functools.cache
def native() -> ModuleType:
    """Return the loaded `pystronghold._C`; raise ExtensionError naming the fix otherwise."""
    try:
        _C = importlib.import_module("pystronghold._C")
    except ImportError as exc:
        raise ExtensionError(load_failure_cause(exc) + ".") from exc
    built = _C.build_info()["source_hash"]
    current = checkout_source_hash()
    if current is not None and current != built:
        raise ExtensionError(
            f"pystronghold._C is stale: it was built from csrc/ sources {built}, but the checkout "
            f"now holds {current}; {REBUILD_HINT}."
        )
    return _C
