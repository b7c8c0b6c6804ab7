import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def real_pair():
    """The real demo pair in float32: (target 1.5B, draft 0.5B)."""
    from verispec.loading import load_model

    return load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")
