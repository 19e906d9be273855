import json
import subprocess
import sys
from pathlib import Path

import pytest

from pystronghold import _ext
from pystronghold.cli import main


def test_info_reports_build(capsys):
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["extension"] == "ok"
    assert facts["simd"] in {"avx512", "avx2", "neon", "scalar"}
    assert facts["simd"] in facts["simd_built"].split(", ") and "scalar" in facts["simd_built"]
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


def test_kernels_install_inside_the_package(tmp_path):
    """kernels/ installs as pystronghold.kernels only: a fresh process away from the source tree
    (the checkout's root taken off sys.path, wherever and under whatever name it was cloned) finds
    no top-level ``kernels`` package made from it."""
    import pystronghold.kernels

    kernels_dir = Path(pystronghold.kernels.__file__).resolve().parent
    code = ("import importlib.util, os, sys\n"
            f"sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != {str(kernels_dir.parent)!r}]\n"
            "import pystronghold.kernels as k\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "print(k.__name__, os.path.realpath(os.path.dirname(k.__file__)))\n"
            "print(None if spec is None else os.path.realpath(os.path.dirname(spec.origin or '')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    package_line, top_level = out.stdout.splitlines()
    assert package_line == f"pystronghold.kernels {kernels_dir}"
    assert top_level != str(kernels_dir), "kernels/ must not be a top-level package"


def test_extension_imports_first_in_a_fresh_process(tmp_path):
    """`import pystronghold._C` before torch: the package imports torch first (its libraries)."""
    code = "import pystronghold._C as C, sys; assert 'torch' in sys.modules; print(C.build_info()['version'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_missing_torch_library_names_torch_not_a_rebuild(monkeypatch):
    exc = ImportError("libc10.so: cannot open shared object file: No such file or directory")
    cause = _ext.load_failure_cause(exc)  # torch imports here: the extension wants another torch
    assert "libc10.so" in cause and "another torch" in cause and torch_version() in cause
    monkeypatch.setitem(sys.modules, "torch", None)  # now `import torch` fails
    cause = _ext.load_failure_cause(exc)
    assert "torch does not import" in cause and "install torch" in cause and "make build" not in cause


def test_torch_missing_altogether_is_named():
    cause = _ext.load_failure_cause(ModuleNotFoundError("No module named 'torch'", name="torch"))
    assert "needs torch" in cause and "install torch" in cause and "make build" not in cause


def test_undefined_symbol_names_a_torch_mismatch():
    cause = _ext.load_failure_cause(ImportError("_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"))
    assert "built against another torch" in cause and torch_version() in cause


def torch_version() -> str:
    import torch

    return torch.__version__


def _imported_modules(root) -> set[str]:
    import ast

    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def _setup_keyword(name: str):
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parents[2] / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}=")


def test_every_third_party_import_is_required_or_an_extra():
    """Each module the package imports is the stdlib, its own, in install_requires, or an extra
    that the option needing it checks (pystronghold.extras)."""
    from pathlib import Path

    from pystronghold.extras import EXTRAS

    repo = Path(__file__).parents[2]
    imported = _imported_modules(repo / "pystronghold") | _imported_modules(repo / "kernels")
    third_party = imported - set(sys.stdlib_module_names) - {"pystronghold", "kernels", "__future__"}
    required = set(_setup_keyword("install_requires"))
    extras = _setup_keyword("extras_require")
    optional = {m for modules in EXTRAS.values() for m in modules}
    assert third_party - required - optional == set()
    distribution = {"yaml": "pyyaml"}  # import name -> pip name, where they differ
    for extra, modules in EXTRAS.items():  # every extra the code names installs those modules
        assert {distribution.get(m, m) for m in modules} <= set(extras[extra]), extra


def test_trace_without_matplotlib_fails_before_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec now answers "not installed"
    assert main(["train", "--steps", "1", "--trace", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trace" in err and "pip install 'pystronghold[plots]'" in err
    assert not (tmp_path / "t").exists()
