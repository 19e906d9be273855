"""A user's install: build a wheel of this checkout, install it into a fresh virtual environment
that holds the pinned torch, and train from outside the source tree.

Slow (it builds the extension; `make test` runs it after `make build`, whose objects in build/ the
wheel build reuses, so it then only links). The fresh venv sees the packages of the project venv
(torch, numpy, ...) through a directory of links, pystronghold itself excluded: what runs is the
installed wheel, never the checkout.
"""

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

CHECK_REQUIREMENTS = """
import re
from importlib.metadata import PackageNotFoundError, distribution, requires
needed = [re.match(r"[A-Za-z0-9_.-]+", r)[0] for r in requires("pystronghold") if "extra ==" not in r]
missing = []
for name in needed:
    try:
        distribution(name)
    except PackageNotFoundError:
        missing.append(name)
assert needed and not missing, f"requirements of pystronghold not installed: {missing}"
"""


def _run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _venv_with_project_dependencies(root: Path) -> Path:
    """A venv whose site-packages sees every package of this interpreter's, except pystronghold."""
    _run([sys.executable, "-m", "venv", root / "venv"])
    python = root / "venv" / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = root / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.startswith(("pystronghold", "__editable__", "_pystronghold")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    (site / "project-dependencies.pth").write_text(f"{deps}\n")
    return python


def test_wheel_installs_into_a_fresh_venv_and_trains_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", wheels, REPO],
         cwd=REPO, timeout=1200)
    (wheel,) = wheels.glob("pystronghold-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.startswith("pystronghold/_C") and n.endswith(".so") for n in names)
    assert "pystronghold/kernels/__init__.py" in names
    for requirement in ("torch", "numpy", "safetensors", "tqdm"):
        assert f"Requires-Dist: {requirement}" in metadata, requirement
    assert "Provides-Extra: plots" in metadata

    python = _venv_with_project_dependencies(tmp_path)
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], timeout=300)
    # every Requires-Dist without an extra marker is installed here (`pip check` would also judge the
    # venv's own old setuptools against torch's metadata, which is not ours to fix)
    _run([python, "-c", CHECK_REQUIREMENTS], timeout=120)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "2"}
    where = _run([python, "-c", "import pystronghold._C, pystronghold; print(pystronghold.__file__)"],
                 cwd=elsewhere, env=env).stdout.strip()
    assert Path(where).resolve().is_relative_to((tmp_path / "venv").resolve()), where  # the wheel, not the checkout

    trace = elsewhere / "trace"
    _run([tmp_path / "venv" / "bin" / "pystronghold", "train", "--steps", "2", "--log-every", "1",
          "--eval-batches", "1", "--max-bytes", "200000", "--quiet", "--trace", trace],
         cwd=elsewhere, env=env, timeout=600)
    for name in ("trace.json", "timeline.png", "loss.png"):
        assert (trace / name).stat().st_size > 0, name
