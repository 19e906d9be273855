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
	    safetensors setuptools wheel
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
	$(PY) bench/adam.py --quick

test: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: build
	$(PY) bench/adam.py --json bench/results/adam.json

# DeepSpeed, for side-by-side runs of bench/adam.py only (not a dependency of pystronghold).
# DS_BUILD_CPU_ADAM=1 compiles DeepSpeedCPUAdam at install time for this host's SIMD; on a
# CPU-only torch DeepSpeed selects its CPU accelerator. The last line proves it imports and steps.
deepspeed: $(DEPS_STAMP)
	DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 $(PY) -m pip install -q --disable-pip-version-check \
	    --no-build-isolation -c constraints.txt deepspeed==0.19.8
	$(PY) -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam as A; \
	    p = torch.nn.Parameter(torch.zeros(4)); p.grad = torch.ones(4); A([p]).step(); print('DeepSpeedCPUAdam ok', p)"

clean:
	rm -rf build pystronghold/_C*.so *.egg-info
