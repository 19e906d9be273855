import json
import subprocess
import sys

import pytest

from pystronghold import _ext
from pystronghold.cli import main


def test_info_reports_build(capsys):
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["extension"] == "ok"
    assert facts["simd"] in {"avx512", "avx2", "neon", "none"}
    assert facts["openmp_threads"] >= 1
    assert facts["torch"].startswith("2.13.0")
    assert "triton" in facts and "cuda_usable" in facts


def test_python_dash_m_info_runs():
    out = subprocess.run([sys.executable, "-m", "pystronghold", "info"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "simd" in out.stdout and "openmp_threads" in out.stdout


def test_extension_matches_checkout():
    assert _ext.native().build_info()["source_hash"] == _ext.checkout_source_hash()


def test_stale_extension_is_reported_with_rebuild_hint(monkeypatch):
    _ext.native.cache_clear()
    monkeypatch.setattr(_ext, "checkout_source_hash", lambda: "0000000000000000")
    with pytest.raises(_ext.ExtensionError, match=r"stale.*make build"):
        _ext.native()
    _ext.native.cache_clear()


def test_missing_extension_is_reported_with_rebuild_hint(monkeypatch):
    _ext.native.cache_clear()
    monkeypatch.setitem(sys.modules, "pystronghold._C", None)  # import of it now fails
    with pytest.raises(_ext.ExtensionError, match=r"not built.*make build"):
        _ext.native()
    _ext.native.cache_clear()


def test_kernels_install_inside_the_package():
    import importlib.util

    import pystronghold.kernels  # noqa: F401

    spec = importlib.util.find_spec("kernels")
    assert spec is None or "pystronghold" not in (spec.origin or ""), "kernels/ must not be a top-level package"
