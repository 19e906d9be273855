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
