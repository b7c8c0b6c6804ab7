import os
import sys
from pathlib import Path

import pytest

import verispec  # noqa: F401  (before torch: it sets how torch's threads wait)
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (thread start-up dwarfs their work); real ones use every core."""
    real = request.node.get_closest_marker("real") is not None
    torch.set_num_threads(os.cpu_count() if real else 1)
    yield


@pytest.fixture(scope="session")
def real_pair():
    """The real demo pair in float32: (target 1.5B, draft 0.5B)."""
    from verispec.loading import load_model

    return load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")
