"""Build of pystronghold and its C++ (and, where possible, CUDA) extension `pystronghold._C`.

Environment variables (all optional):
  PYSTRONGHOLD_SIMD   which SIMD variants of the kernels to compile into _C (one is picked at load time
                      from the CPU's features): all (default: avx512, avx2, scalar on x86-64; neon,
                      scalar on aarch64), native (the building host's best, plus scalar), or one name
                      (avx512, avx2, neon, scalar; `none` means scalar); scalar is always built.
  PYSTRONGHOLD_CUDA   auto (default: build CUDA sources only when a CUDA toolkit AND a CUDA build of
                      torch are both present), 1 (force: fail if impossible), 0 (never).
  DEBUG=1             -O0 -g instead of -O3.
  PYSTRONGHOLD_VERBOSE_BUILD=1  the compiler's output on the terminal (default: one line per source
                      there, the full output in build/build.log, shown when the build fails).
  PYSTRONGHOLD_NO_EXTENSION=1   install the Python packages only (the Makefile makes the editable
                      install this way, then builds _C in place with ninja so rebuilds are incremental).
"""

import contextlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
VERSION = "0.1.0"


# ---- SIMD variants: every kernel that includes csrc/simd.h is compiled once per variant
# (csrc/simd_<isa>.cpp) and csrc/simd_dispatch.cpp picks one at load time from the CPU's features.

ARCH_VARIANTS = {"x86_64": ("avx512", "avx2", "scalar"), "aarch64": ("neon", "scalar")}
"""The variants each architecture can build, best first (scalar is always built: the fallback)."""


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _host_cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _host_best(available: tuple) -> str:
    flags = _host_cpu_flags()
    if "avx512" in available and {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"} <= flags:
        return "avx512"
    if "avx2" in available and {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return available[0] if available[0] == "neon" else "scalar"


def choose_simd_variants() -> list:
    """The variants to build from PYSTRONGHOLD_SIMD: all (default), native (the building host's best),
    or one name (that one); scalar is always added."""
    available = ARCH_VARIANTS.get(_arch(), ("scalar",))
    requested = os.environ.get("PYSTRONGHOLD_SIMD", "all").strip().lower()
    requested = "scalar" if requested == "none" else requested
    if requested == "all":
        return list(available)
    if requested == "native":
        requested = _host_best(available)
    if requested not in available:
        sys.exit(f"PYSTRONGHOLD_SIMD={requested!r}: expected all, native or one of {', '.join(available)} "
                 f"on {_arch()}")
    return [requested] + ([] if requested == "scalar" else ["scalar"])


# ---- CUDA

def cuda_wanted() -> bool:
    mode = os.environ.get("PYSTRONGHOLD_CUDA", "auto").strip().lower()
    if mode in ("0", "no", "off", "false"):
        return False
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    # NOTE: torch guesses CUDA_HOME from nvcc's folder; where nvcc is a wrapper script (e.g.
    # /usr/local/bin/nvcc) that guess holds no headers, and the build would fail deep inside nvcc
    toolkit = home is not None and (Path(home) / "include" / "cuda_runtime_api.h").is_file()
    possible = torch.version.cuda is not None and toolkit
    why_not = (f"a CUDA build needs both a CUDA build of torch (torch.version.cuda={torch.version.cuda}) "
               f"and a CUDA toolkit (CUDA_HOME={home}"
               f"{'' if home is None or toolkit else ' holds no include/cuda_runtime_api.h'})")
    if mode in ("1", "yes", "on", "true", "force"):
        if not possible:
            sys.exit(f"PYSTRONGHOLD_CUDA=1 but {why_not}; set CUDA_HOME to the toolkit's root or unset "
                     "PYSTRONGHOLD_CUDA.")
        return True
    if mode != "auto":
        sys.exit(f"PYSTRONGHOLD_CUDA={mode!r}: expected auto, 1 or 0")
    if not possible and torch.version.cuda is not None:
        print(f"pystronghold: building for CPU only: {why_not}; set CUDA_HOME to the toolkit's root "
              "for the CUDA side")
    return possible


def nvidia_wheel_dirs() -> tuple:
    """torch's CUDA headers include cusparse.h etc., which ship in the nvidia-* wheels."""
    try:
        import nvidia  # noqa: F401
    except ImportError:
        return [], []
    base = Path(list(nvidia.__path__)[0])
    includes = sorted(str(p) for p in base.glob("*/include") if p.is_dir())
    libs = sorted(str(p) for p in base.glob("*/lib") if p.is_dir())
    return includes, libs


# ---- build identity, compiled into build_info.cpp only (so only that file rebuilds)

def source_hash() -> str:
    """Hash of csrc/, computed by the same function pystronghold._ext uses to detect a stale build."""
    spec = importlib.util.spec_from_file_location("_pystronghold_ext", ROOT / "pystronghold" / "_ext.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.checkout_source_hash()


def compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return cxx


def _write_if_changed(target: Path, text: str) -> None:
    if not target.exists() or target.read_text() != text:  # keep mtime: no needless rebuild
        target.write_text(text)


def write_build_info(variants: list, with_cuda: bool, debug: bool) -> Path:
    # NOTE: CPU and CUDA builds keep apart generated headers, so `make cuda-check` never makes the
    # CPU build in the tree recompile (or look stale).
    gen = ROOT / "build" / ("generated-cuda" if with_cuda else "generated")
    gen.mkdir(parents=True, exist_ok=True)
    _write_if_changed(gen / "ps_build_info.h", (
        "// Generated by setup.py: what this extension was built from and with.\n"
        "#pragma once\n"
        f'#define PYSTRONGHOLD_VERSION "{VERSION}"\n'
        f'#define PYSTRONGHOLD_SOURCE_HASH "{source_hash()}"\n'
        f'#define PYSTRONGHOLD_COMPILER "{compiler_version()}"\n'
        f'#define PYSTRONGHOLD_BUILD_TYPE "{"debug" if debug else "release"}"\n'
        f"#define PYSTRONGHOLD_BUILT_WITH_CUDA {1 if with_cuda else 0}\n"
    ))
    # Only csrc/simd_dispatch.cpp includes this one: changing the variant set recompiles just it.
    _write_if_changed(gen / "ps_simd_variants.h", (
        "// Generated by setup.py (PYSTRONGHOLD_SIMD): the SIMD variants compiled into this extension.\n"
        "#pragma once\n"
        + "".join(f"#define PYSTRONGHOLD_BUILT_{v.upper()} 1\n" for v in variants)
    ))
    return gen


def cxx_standard() -> str:
    """C++17, or C++20 where torch's headers need it (torch >= 2.14 uses <=>, concepts)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def sources_for(variants: list) -> list:
    """csrc/*.cpp, without the SIMD variant sources (simd_<isa>.cpp) of variants not built."""
    skipped = {f"simd_{v}.cpp" for v in ("avx512", "avx2", "neon", "scalar") if v not in variants}
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp") if p.name not in skipped)


def compiler_cache() -> str:
    """The compiler cache a rebuild from scratch reuses: torch's ninja build puts ccache (or sccache)
    in front of the compiler when one is on PATH, unless TORCH_NO_COMPILER_WRAPPER is set."""
    if os.environ.get("TORCH_NO_COMPILER_WRAPPER"):
        return "off (TORCH_NO_COMPILER_WRAPPER)"
    found = next((name for name in ("ccache", "sccache") if shutil.which(name)), None)
    return found or "none (install ccache to make rebuilds from scratch fast)"


def extensions():
    from torch.utils import cpp_extension

    variants = choose_simd_variants()
    with_cuda = cuda_wanted()
    debug = os.environ.get("DEBUG", "0") == "1"
    generated = write_build_info(variants, with_cuda, debug)

    # NOTE: -g0 overrides the -g in Python's own CFLAGS: release builds need no debug info, and it
    # costs compile time and a larger .so. No -m ISA flag: the library is built for the baseline of
    # its architecture; only the variant sources' kernels use more (a target pragma, csrc/simd.h).
    opt = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    std = cxx_standard()
    # NOTE: torch's and Python's headers are system headers (-isystem wins over setuptools' -I for
    # the same directory), so their warnings are not ours to read; ours stay at -Wall.
    system_dirs = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    system = [f for d in system_dirs for f in ("-isystem", d)]
    cxx_flags = [f"-std={std}", "-fopenmp", "-Wall", "-Wno-unknown-pragmas", "-Wno-c++20-extensions", *opt, *system]
    sources = sources_for(variants)
    include_dirs = [str(CSRC), str(generated)]
    library_dirs = []
    define_macros = []
    print(f"pystronghold: building _C for CPU{' + CUDA' if with_cuda else ' only'}, SIMD variants "
          f"{', '.join(variants)}, {'debug' if debug else 'release'}, {len(sources)} C++ sources, "
          f"compiler cache {compiler_cache()}")
    if not with_cuda:
        return [cpp_extension.CppExtension(
            "pystronghold._C", sources, include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags}, extra_link_args=["-fopenmp"])]

    sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu"))
    inc, libs = nvidia_wheel_dirs()
    include_dirs += inc
    library_dirs += libs
    define_macros.append(("PYSTRONGHOLD_WITH_CUDA", "1"))
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    nvcc_flags = [*(["-O0", "-g"] if debug else ["-O3"]), f"-std={std}", "-DPYSTRONGHOLD_WITH_CUDA=1"]
    if not arch:
        nvcc_flags += ["-gencode=arch=compute_90,code=sm_90"]
    return [cpp_extension.CUDAExtension(
        "pystronghold._C", sources, include_dirs=include_dirs, library_dirs=library_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": [*cxx_flags, "-DPYSTRONGHOLD_WITH_CUDA=1"], "nvcc": nvcc_flags},
        extra_link_args=["-fopenmp"])]


# ---- quiet build: the compiler's output goes to build/build.log, the terminal gets progress

BUILD_LOG = ROOT / "build" / "build.log"
_NINJA_COMPILE = re.compile(r"^\[(\d+)/(\d+)\] .* (\S+\.(?:cpp|cu)) -o ")  # ninja -v: step, source


@contextlib.contextmanager
def compiler_output_to_log(log_path: Path):
    """Send everything written to file descriptors 1 and 2 (ninja and the compilers included) to
    ``log_path``; print one line per compiled source, our own warnings, and the whole log on failure."""
    if os.environ.get("PYSTRONGHOLD_VERBOSE_BUILD") == "1":
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    saved_out, saved_err = os.dup(1), os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    counts = {"warnings": 0}

    def pump() -> None:
        with open(read_end, "rb") as src, open(log_path, "wb") as log:
            for raw in src:
                log.write(raw)
                line = raw.decode(errors="replace")
                step = _NINJA_COMPILE.match(line)
                if step:
                    source = os.path.relpath(step[3], ROOT) if os.path.isabs(step[3]) else step[3]
                    terminal.write(f"pystronghold: [{step[1]}/{step[2]}] compiling {source}\n")
                elif "warning:" in line:
                    counts["warnings"] += 1
                    if "/csrc/" in line or line.startswith("csrc/"):  # ours: show it
                        terminal.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)  # the pipe's last writers go: the reader sees its end
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        reader.join()
        if ok:
            terminal.write(f"pystronghold: built ({counts['warnings']} compiler warnings, all output in "
                           f"{os.path.relpath(log_path)})\n")
        else:
            terminal.write(log_path.read_text(errors="replace"))
            terminal.write(f"pystronghold: the build failed; the compiler output is above and in {log_path}\n")
        terminal.close()


def build_ext_class():
    from torch.utils.cpp_extension import BuildExtension

    class QuietBuildExtension(BuildExtension):
        def build_extensions(self):
            with compiler_output_to_log(BUILD_LOG):
                super().build_extensions()

    return QuietBuildExtension.with_options(use_ninja=True)


def main():

    setup(
        name="pystronghold",
        version=VERSION,
        description="Train models larger than GPU memory: a layer window on the device, "
                    "the rest in host memory and on NVMe, with a fused CPU Adam.",
        long_description=(ROOT / "README.md").read_text(),
        long_description_content_type="text/markdown",
        python_requires=">=3.10",
        packages=["pystronghold", "pystronghold.kernels"]
        + [".".join(("pystronghold", *init.parent.relative_to(ROOT / "pystronghold").parts))
           for init in sorted((ROOT / "pystronghold").glob("*/**/__init__.py"))],  # nested ones (runtime/'s) too
        # kernels/ lives at the top of the repository but installs as pystronghold.kernels
        package_dir={"pystronghold.kernels": "kernels"},
        ext_modules=[] if os.environ.get("PYSTRONGHOLD_NO_EXTENSION") == "1" else extensions(),
        cmdclass={"build_ext": build_ext_class()},
        # NOTE: what `pystronghold train` imports unconditionally; the extras are checked by the option
        # that needs them (pystronghold/extras.py) with the pip line to run.
        install_requires=["torch", "numpy", "safetensors", "tqdm"],
        extras_require={
            "plots": ["matplotlib"],   # --trace: timeline.png, loss.png
            "kernels": ["triton"],     # the Triton kernels on CUDA (torch's CUDA wheels bring it)
            "hf": ["transformers", "tokenizers"],  # --model hf:DIR, export --hf, from_pretrained
            "yaml": ["pyyaml"],        # plan --cluster FILE.yaml (JSON needs nothing)
            "peft": ["peft", "accelerate"],  # train --lora-rank, export --hf of LoRA adapters; accelerate: bench baseline
            "data": ["datasets"],      # train --data DIR written by datasets' save_to_disk
            "dev": ["pytest", "pytest-timeout", "hypothesis", "matplotlib", "ninja", "transformers", "tokenizers", "pyyaml",
                    "tensorboard", "peft", "accelerate", "datasets"],
        },
        entry_points={"console_scripts": ["pystronghold=pystronghold.cli:run"]},
        zip_safe=False,
    )


if __name__ == "__main__":
    main()
