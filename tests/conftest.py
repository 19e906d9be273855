import os

# NOTE: before torch loads OpenMP: the runtime's host Adam (an OpenMP team on a worker thread) and
# torch's team spin against each other on 2 cores otherwise (seconds per step); the CLI does the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def seed_everything():
    """Every test starts from the same random state, so a failure reproduces."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
