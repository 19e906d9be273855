"""GPU tests: what the CPU backend and its twin cannot show (pinned memory, CUDA streams and
events, TF32 against exact fp32). Every test under tests/gpu/ is skipped, with the reason, when
torch sees no CUDA device; `make gpu-test` builds _C with CUDA and runs them with the whole suite."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False); run `make gpu-test` on a GPU machine"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def cuda_build():
    """The extension's build info; skips (naming the fix) when _C was built without CUDA."""
    from pystronghold._ext import native

    info = native().build_info()
    if not info["with_cuda"]:
        pytest.skip("pystronghold._C was built without CUDA: `make gpu-test` builds it with PYSTRONGHOLD_CUDA=1")
    return info
