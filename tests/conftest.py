# NOTE: imported before torch so its OMP_WAIT_POLICY default takes effect (see pystronghold/__init__.py).
import pystronghold  # noqa: F401

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
