# NOTE: imported before torch so its OMP_WAIT_POLICY default takes effect (see pystronghold/__init__.py).
import pystronghold  # noqa: F401

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# NOTE: tests live in folders by package (tests/runtime/, tests/io/, ...); the helpers they share
# (runtime_models, train_helpers, hf_models, parallel_training, tmpfs, _dist) stay here, importable
# from every folder. A test module imports helpers only, never another test module
# (tests/package/test_package_test_imports.py), so a run of one file needs no other folder on the path.
_TESTS = Path(__file__).parent
sys.path.insert(0, str(_TESTS))


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def peft():
    """The ``peft`` package (the test is skipped without it), imported when the test runs. NOTE: not
    when its module is collected: peft imports triton.language, which must come after
    tests/models/test_models_loss.py has switched the Triton interpreter on."""
    return pytest.importorskip("peft")


_DEVICE_FOLDERS = (_TESTS / "gpu", _TESTS / "triton")
_DEVICE_MODULES = {_TESTS / "models" / "test_models_loss.py"}  # its Triton cross-entropy runs on the device


def pytest_collection_modifyitems(config, items):
    """Mark what `pytest -m gpu` (make gpu-test, bench/gpu_verify.py) runs on a GPU: the GPU folder,
    the Triton kernel tests (on the device there, in the interpreter here) and the tests marked
    ``@pytest.mark.gpu`` in their own modules."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path in _DEVICE_MODULES or any(folder in path.parents for folder in _DEVICE_FOLDERS):
            item.add_marker(pytest.mark.gpu)
