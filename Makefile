# Set-up and checks. `make demo` and `make test` work on a fresh machine: they create .venv,
# install the pinned dependencies, build the extension, then run.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.editable-stamp
PYTEST_ARGS ?=

.PHONY: build demo test bench cuda-check deepspeed clean

$(DEPS_STAMP): constraints.txt
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt \
	    torch==2.13.0 triton numpy ninja pytest pytest-timeout hypothesis tqdm matplotlib \
	    safetensors setuptools wheel transformers tokenizers
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
# (pinning host memory) must raise a clear error without a device.
CUDA_VENV ?= .venv-cuda
CUDA_PY := $(CUDA_VENV)/bin/python
CUDA_DEPS_STAMP := $(CUDA_VENV)/.deps-stamp
CUDA_CHECK_DIR := build/cuda-check
NVCC_ROOT := $(shell dirname "$$(dirname "$$(command -v nvcc)")")

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
print(f"cuda-check: ok (torch {torch.__version__}, CUDA runtime {info.get('cuda_runtime_version')})")
endef
export CUDA_CHECK_PY

cuda-check: $(CUDA_DEPS_STAMP)
	CUDA_HOME=$${CUDA_HOME:-$(NVCC_ROOT)/cuda} PYSTRONGHOLD_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
	    $(CUDA_PY) setup.py -q build_ext --build-lib $(CUDA_CHECK_DIR)/lib --build-temp $(CUDA_CHECK_DIR)/temp
	rm -rf $(CUDA_CHECK_DIR)/pkg && mkdir -p $(CUDA_CHECK_DIR)/pkg
	cp -r pystronghold $(CUDA_CHECK_DIR)/pkg/ && rm -f $(CUDA_CHECK_DIR)/pkg/pystronghold/_C*.so
	cp $(CUDA_CHECK_DIR)/lib/pystronghold/_C*.so $(CUDA_CHECK_DIR)/pkg/pystronghold/
	cd $(CUDA_CHECK_DIR)/pkg && $(abspath $(CUDA_PY)) -c "$$CUDA_CHECK_PY"

clean:
	rm -rf build pystronghold/_C*.so *.egg-info
