# NOTE: imported before torch so its OMP_WAIT_POLICY default takes effect (see pystronghold/__init__.py).
import pystronghold  # noqa: F401

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# NOTE: tests live in folders by package (tests/runtime/, tests/io/, ...); the helpers they share
# (runtime_models, train_helpers, hf_models, _dist) stay here, importable from every folder. A few
# test modules still import helpers from another folder's test module (test_runtime_resident from
# test_train_checkpoint and test_parallel_runtime; test_runtime_nvme from test_file_store), so every
# folder is on the path too: a run of one file must not depend on which other files were collected.
_TESTS = Path(__file__).parent
sys.path[:0] = [str(_TESTS)] + sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and d.name != "__pycache__")


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
