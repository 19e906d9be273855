# Set-up and checks. `make demo` and `make test` work on a fresh machine: they create .venv,
# install the pinned dependencies, build the extension, then run.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.editable-stamp
PYTEST_ARGS ?=

.PHONY: build demo test bench cuda-check gpu-stack-check gpu-test gpu-verify gpu-verify-big deepspeed clean

$(DEPS_STAMP): constraints.txt
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt \
	    torch==2.13.0 triton numpy ninja pytest pytest-timeout hypothesis tqdm matplotlib \
	    safetensors setuptools wheel transformers tokenizers tensorboard pyyaml peft accelerate datasets
	@touch $@

# The editable install (Python packages only) is made once, and again when the build description
# changes; `build_ext --inplace` then builds _C incrementally with ninja (only changed sources).
$(BUILD_STAMP): $(DEPS_STAMP) setup.py pyproject.toml
	PYSTRONGHOLD_NO_EXTENSION=1 $(PY) -m pip install -q --disable-pip-version-check \
	    --no-build-isolation --no-deps -e .
	@touch $@

build: $(BUILD_STAMP)
	$(PY) setup.py -q build_ext --inplace
	$(PY) -m pystronghold info

demo: build
	$(PY) -m pystronghold train

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: build
	$(PY) -m pystronghold bench --full --out bench/results

# DeepSpeed, for side-by-side runs of bench/adam.py only (not a dependency of pystronghold).
# DS_BUILD_CPU_ADAM=1 compiles DeepSpeedCPUAdam at install time for this host's SIMD; on a
# CPU-only torch DeepSpeed selects its CPU accelerator. The last line proves it imports and steps.
deepspeed: $(DEPS_STAMP)
	DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 $(PY) -m pip install -q --disable-pip-version-check \
	    --no-build-isolation -c constraints.txt deepspeed==0.19.8
	$(PY) -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam as A; \
	    p = torch.nn.Parameter(torch.zeros(4)); p.grad = torch.ones(4); A([p]).step(); print('DeepSpeedCPUAdam ok', p)"

# ---- cuda-check: the CUDA side must compile, link and import on this GPU-less machine.
# A separate venv holds the CUDA build of torch (../shared/CUDA_BUILD.md); _C is built with CUDA
# forced on into build/cuda-check (its own objects and generated header: the CPU build's .so in
# the tree is never touched), imported from a staged copy of the package, and a CUDA entry point
# (pinning host memory) must raise a clear error without a device. It also constructs a HostArena,
# a CopyEngine and a FileStore and runs file I/O error paths there: the CUDA build is compiled
# with other flags and linked against another torch than the CPU build the tests use.
CUDA_VENV ?= .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_DEPS_STAMP := $(CUDA_VENV)/.deps-stamp
CUDA_CHECK_DIR := build/cuda-check
NVCC_ROOT := $(shell dirname "$$(dirname "$$(command -v nvcc)")")
# The toolkit root torch's build needs (../shared/CUDA_BUILD.md): CUDA_HOME when set, else the `cuda`
# folder beside nvcc's (torch's own guess from a wrapper script holds no headers here).
WITH_TOOLKIT := CUDA_HOME=$${CUDA_HOME:-$(NVCC_ROOT)/cuda}

$(CUDA_DEPS_STAMP):
	@test -x $(CUDA_PY) || $(PYTHON_BOOT) -m venv $(CUDA_VENV)
	$(CUDA_PY) -m pip install -q --disable-pip-version-check torch==2.14.1 numpy ninja setuptools wheel
	@touch $@

define CUDA_CHECK_PY
import torch
from pystronghold._ext import native
from pystronghold.io import CopyEngine, HostArena
info = native().build_info()
assert info["with_cuda"], f"the extension was built without CUDA: {info}"
assert not torch.cuda.is_available(), "this check expects a machine without a usable GPU"
try:
    HostArena(1 << 20, pin="cuda")
except RuntimeError as exc:
    assert "no usable CUDA device" in str(exc), exc
    print(f"cuda-check: HostArena(pin='cuda') without a device -> {exc}")
else:
    raise SystemExit("cuda-check: HostArena(pin='cuda') succeeded without a device")
assert not HostArena(1 << 20).pinned  # pin='auto' without a device: plain page-aligned memory
with CopyEngine() as engine:
    src, dst = torch.arange(1000.0), torch.empty(1000)
    engine.copy(dst, src).wait()
    assert torch.equal(src, dst)
    # The file tier and its error paths in this build: a never-written record and a failing write
    # (EFBIG under RLIMIT_FSIZE) must raise CopyError with the message, never crash
    # (docs/DESIGN.md, "No iostreams in csrc/").
    import resource, signal, tempfile
    from pystronghold.io import CopyError, FileStore
    with tempfile.TemporaryDirectory() as tmp:
        open(tmp + "/file", "w").close()
        try:
            FileStore.create(tmp + "/file/s", num_blocks=1, record_bytes={"m": 4096}, engine=engine)
        except (OSError, RuntimeError) as exc:
            print(f"cuda-check: FileStore under a regular file -> {type(exc).__name__}")
        else:
            raise SystemExit("cuda-check: FileStore.create under a regular file succeeded")
        store = FileStore.create(tmp + "/store", num_blocks=4, record_bytes={"m": 64 << 10}, engine=engine,
                                 segment_bytes=4096, preallocate=False)
        record = torch.arange(64 << 10, dtype=torch.int32).to(torch.uint8)
        store.write(0, "m", record).wait()
        back = torch.empty_like(record)
        store.read(0, "m", back).wait()
        assert torch.equal(back, record)
        try:
            store.read(3, "m", back).wait()
        except CopyError as exc:
            assert "was never written" in str(exc), exc
            print(f"cuda-check: read of a never-written record -> CopyError: {exc}")
        else:
            raise SystemExit("cuda-check: reading a never-written record succeeded")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, limits[1]))  # the header fits, record 3 not
        error = None
        try:
            store.write(3, "m", record).wait()
        except CopyError as exc:
            error = exc
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)  # before any print: stdout may be a file
        if error is None:
            raise SystemExit("cuda-check: a write past RLIMIT_FSIZE succeeded")
        assert error.errno != 0 and str(store.path("m")) in str(error), error
        print(f"cuda-check: write past RLIMIT_FSIZE -> CopyError: {error}")
print(f"cuda-check: ok (torch {torch.__version__}, CUDA runtime {info.get('cuda_runtime_version')})")
endef
export CUDA_CHECK_PY

cuda-check: $(CUDA_DEPS_STAMP)
	$(WITH_TOOLKIT) PYSTRONGHOLD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
	    $(CUDA_PY) setup.py -q build_ext --build-lib $(CUDA_CHECK_DIR)/lib --build-temp $(CUDA_CHECK_DIR)/temp
	rm -rf $(CUDA_CHECK_DIR)/pkg && mkdir -p $(CUDA_CHECK_DIR)/pkg
	cp -r pystronghold $(CUDA_CHECK_DIR)/pkg/ && rm -f $(CUDA_CHECK_DIR)/pkg/pystronghold/_C*.so
	cp $(CUDA_CHECK_DIR)/lib/pystronghold/_C*.so $(CUDA_CHECK_DIR)/pkg/pystronghold/
	cd $(CUDA_CHECK_DIR)/pkg && $(abspath $(CUDA_PY)) -c "$$CUDA_CHECK_PY"

# ---- gpu-stack-check: the GPU machine's software (../shared/GPU.md: Python 3.12, torch 2.11.0+cu130,
# triton 3.6.0, transformers 5.17.0, no DeepSpeed, no datasets) in its own venv, on this GPU-less
# machine: the CUDA build of _C against that torch, cuda-check's script, both verification dry runs,
# and the suite but for what a GPU runs (`-m gpu`: here the Triton interpreter, which triton 3.6's
# cannot run without a GPU) and the check of .venv's pinned torch. `make test` runs on .venv's newer
# torch; this shows the package imports, builds and runs on the older one before a lent GPU's
# minutes are spent finding out. About 5 GB from PyPI once, then about 12 minutes; not part of
# `make test`. The .so it builds is Python 3.12's, beside .venv's.
STACK_VENV ?= .venv-gpu-stack
STACK_PY := $(STACK_VENV)/bin/python
STACK_DEPS_STAMP := $(STACK_VENV)/.deps-stamp
STACK_OUT ?= build/gpu-stack

$(STACK_DEPS_STAMP):
	@test -x $(STACK_PY) || python3.12 -m venv $(STACK_VENV)
	$(STACK_PY) -m pip install -q --disable-pip-version-check torch==2.11.0 triton==3.6.0 \
	    transformers==5.17.0 peft accelerate safetensors numpy ninja setuptools wheel pytest \
	    pytest-xdist pytest-timeout hypothesis tqdm matplotlib tensorboard pyyaml
	@touch $@

gpu-stack-check: $(STACK_DEPS_STAMP)
	PYSTRONGHOLD_NO_EXTENSION=1 $(STACK_PY) -m pip install -q --disable-pip-version-check \
	    --no-build-isolation --no-deps -e .
	$(WITH_TOOLKIT) PYSTRONGHOLD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
	    $(STACK_PY) setup.py -q build_ext --inplace
	$(STACK_PY) -c "$$CUDA_CHECK_PY"
	$(WITH_TOOLKIT) $(MAKE) --no-print-directory gpu-verify GPU_VERIFY_DRY=1 \
	    GPU_PY=$(STACK_PY) GPU_OUT=$(STACK_OUT)/verify
	$(WITH_TOOLKIT) $(MAKE) --no-print-directory gpu-verify-big GPU_VERIFY_DRY=1 \
	    GPU_PY=$(STACK_PY) GPU_OUT=$(STACK_OUT)/big
	$(STACK_PY) -m pytest -q -p no:cacheprovider -m "not gpu" \
	    --deselect tests/package/test_package_extension_and_extras.py::test_info_reports_build tests

# ---- On a machine with a CUDA GPU (../shared/GPU.md). GPU_PY: a Python whose torch is a CUDA build:
# .venv's when there is one, else python3 (a GPU machine whose system Python already holds torch);
# `make gpu-test GPU_PY=...`.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)

# gpu-verify / gpu-verify-big: the prepared verification a lent GPU runs first (bench/gpu_verify.py:
# every stage under its own timeout, each run even when an earlier one failed, REPORT.md +
# report.json + log.txt into GPU_OUT, default $OUT/<target> when the device tool sets OUT, else
# build/gpu-report; scratch in GPU_WORK, default build/gpu-verify-work; GPU_BUDGET: seconds for the
# whole suite, default 420 (gpu-verify) and 330 (gpu-verify-big), so both and the machine's start fit a
# lent GPU's 15 minutes; GPU_COMMIT: the commit the report names, since the device tool's copy of the
# tree may carry another git HEAD). GPU_VERIFY_DRY=1: the same driver on the CPU, tiny and short.
GPU_VERIFY_FLAGS = --out $(or $(GPU_OUT),$(if $(OUT),$(OUT)/$@,build/gpu-report)) $(if $(GPU_COMMIT),--commit $(GPU_COMMIT)) $(if $(GPU_BUDGET),--budget $(GPU_BUDGET)) $(if $(GPU_WORK),--work $(GPU_WORK)) $(if $(GPU_VERIFY_DRY),--dry-run) --python $(GPU_PY)

gpu-verify:
	$(GPU_PY) bench/gpu_verify.py verify $(GPU_VERIFY_FLAGS)

gpu-verify-big:
	$(GPU_PY) bench/gpu_verify.py big $(GPU_VERIFY_FLAGS)

# gpu-test: build _C with CUDA in place for this GPU's architecture and run the tests that need the
# device (`pytest -m gpu`: tests/gpu, the other CUDA tests, the Triton kernel tests); the whole suite
# does not fit a lent GPU's 10-minute command (PYTEST_ARGS=tests runs it all the same).
gpu-test:
	@$(GPU_PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	    f'make gpu-test: torch {torch.__version__} sees no CUDA device (use make test / make cuda-check here)')"
	PYSTRONGHOLD_NO_EXTENSION=1 $(GPU_PY) -m pip install -q --disable-pip-version-check \
	    --no-build-isolation --no-deps -e .
	PYSTRONGHOLD_CUDA=1 MAX_JOBS=$${MAX_JOBS:-$$(nproc)} TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-$$($(GPU_PY) \
	    -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}" \
	    $(GPU_PY) setup.py -q build_ext --inplace
	$(GPU_PY) -c "from pystronghold._ext import native; i = native().build_info(); \
	    assert i['with_cuda'], f'_C was built without CUDA: {i}'; print('gpu-test: _C built with CUDA', i)"
	$(GPU_PY) -m pytest -q -p no:cacheprovider $(if $(PYTEST_ARGS),$(PYTEST_ARGS),-m gpu tests)

clean:
	rm -rf build pystronghold/_C*.so *.egg-info
