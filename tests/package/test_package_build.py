"""setup.py's quiet build: one line per compiled source on the terminal, our warnings shown,
everything in the log, and the whole log on the terminal when the build fails."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

NINJA_LIKE = """
echo "[1/2] c++ -MMD -I/x -c -c $PWD/csrc/adam.cpp -o build/adam.o -O3"
echo "/usr/lib/gcc/x86_64-linux-gnu/12/include/avx512fintrin.h:1: warning: '__Y' may be used uninitialized"
echo "[2/2] c++ -MMD -c -c csrc/simd_avx2.cpp -o build/simd_avx2.o"
echo "$PWD/csrc/simd_avx2.cpp:7:3: warning: unused variable 'x'" >&2
"""


def _setup_module():
    spec = importlib.util.spec_from_file_location("pystronghold_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


def test_quiet_build_prints_progress_and_our_warnings(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("PYSTRONGHOLD_VERBOSE_BUILD", raising=False)
    setup = _setup_module()
    log = tmp_path / "build.log"
    with setup.compiler_output_to_log(log):
        subprocess.run(["sh", "-c", NINJA_LIKE], cwd=REPO, check=True)
    terminal = capfd.readouterr()
    lines = (terminal.out + terminal.err).strip().splitlines()
    assert lines[0] == "pystronghold: [1/2] compiling csrc/adam.cpp"
    assert lines[1] == "pystronghold: [2/2] compiling csrc/simd_avx2.cpp"
    assert "unused variable 'x'" in lines[2]  # ours
    assert lines[3].startswith("pystronghold: built (2 compiler warnings")
    assert len(lines) == 4  # the system header's warning is only in the log
    assert "avx512fintrin.h" in log.read_text() and "unused variable" in log.read_text()


def test_failed_build_shows_the_whole_log(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("PYSTRONGHOLD_VERBOSE_BUILD", raising=False)
    setup = _setup_module()
    log = tmp_path / "build.log"
    with pytest.raises(RuntimeError, match="ninja failed"):
        with setup.compiler_output_to_log(log):
            subprocess.run(["sh", "-c", "echo 'csrc/adam.cpp:3:1: error: boom'; echo 'some context' >&2"], check=True)
            raise RuntimeError("ninja failed")
    terminal = capfd.readouterr()
    shown = terminal.out + terminal.err
    assert "error: boom" in shown and "some context" in shown and "the build failed" in shown and str(log) in shown


@pytest.mark.parametrize("headers", [False, True])
def test_cuda_home_without_the_toolkits_headers_is_no_toolkit(tmp_path, capfd, monkeypatch, headers):
    """torch guesses CUDA_HOME from nvcc's folder, which for a wrapper script holds no headers: auto
    builds for CPU and says why, forced CUDA stops with that reason, a real toolkit is taken."""
    import torch
    from torch.utils import cpp_extension

    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    if headers:
        (home / "include" / "cuda_runtime_api.h").write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    setup = _setup_module()
    monkeypatch.setenv("PYSTRONGHOLD_CUDA", "auto")
    assert setup.cuda_wanted() is headers
    printed = capfd.readouterr().out
    assert ("holds no include/cuda_runtime_api.h" in printed) is not headers
    monkeypatch.setenv("PYSTRONGHOLD_CUDA", "1")
    if headers:
        assert setup.cuda_wanted() is True
    else:
        with pytest.raises(SystemExit, match=f"CUDA_HOME={home} holds no include/cuda_runtime_api.h"):
            setup.cuda_wanted()
