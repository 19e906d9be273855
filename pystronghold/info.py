"""What this installation is and can do: `pystronghold info`."""

from __future__ import annotations

import importlib.util
import os
import platform


def triton_status() -> str:
    """'usable (GPU)', 'interpreter only (...)' or 'not installed'."""
    if importlib.util.find_spec("triton") is None:
        return "not installed"
    import torch

    if torch.cuda.is_available():
        return "usable (GPU)"
    mode = "on" if os.environ.get("TRITON_INTERPRET") == "1" else "off"
    return f"interpreter only (no GPU; TRITON_INTERPRET={mode})"


def collect() -> dict:
    """Facts about this installation as a flat dict of strings, ints and bools."""
    import torch

    from pystronghold import __version__
    from pystronghold._ext import ExtensionError, native

    facts: dict = {
        "pystronghold": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda or "no",
        "cuda_usable": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "triton": triton_status(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        build = native().build_info()
    except ExtensionError as exc:
        facts["extension"] = f"ERROR: {exc}"
        return facts
    facts.update({
        "extension": "ok",
        "extension_with_cuda": build["with_cuda"],
        "compiler": build["compiler"],
        "simd": build["simd"],
        "simd_built": ", ".join(native().simd_variants()),
        "build_type": build["build_type"],
        "openmp_threads": build["openmp_max_threads"],
        "source_hash": build["source_hash"],
    })
    return facts
