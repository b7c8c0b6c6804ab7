import os
import sys
from pathlib import Path

import pytest

import verispec  # noqa: F401  (before torch: it sets how torch's threads wait)
import torch

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402  (found through the path above)


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (thread start-up dwarfs their work); real ones use every core."""
    real = request.node.get_closest_marker("real") is not None
    torch.set_num_threads(os.cpu_count() if real else 1)
    yield


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Qwen2-shaped target, loaded from its folder (a module may define its own)."""
    from verispec.loading import load_model

    path = tmp_path_factory.mktemp("target")
    tiny.save_hf_model(path, "qwen2", seed=1)
    return load_model(path)


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory):
    """A tiny one-layer Llama-shaped draft with other weights: most of its drafts are rejected."""
    from verispec.loading import load_model

    path = tmp_path_factory.mktemp("draft")
    tiny.save_hf_model(path, "llama", seed=2, num_hidden_layers=1)
    return load_model(path)


@pytest.fixture(scope="session")
def real_pair():
    """The real demo pair in float32: (target 1.5B, draft 0.5B)."""
    from verispec.loading import load_model

    return load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")


class ModelledClock:
    """Decoding time without a shared machine's noise: each forward pass of a model over m positions
    costs (1 + (m - 1) / 20) ms, plus `extra_s` while set, on the clock the decoding loop reads."""

    def __init__(self):
        self.now = 0.0
        self.extra_s = 0.0

    def pass_hook(self, module, args) -> None:
        if hasattr(module, "new_cache"):  # a whole model, not one of its layers
            self.now += 1e-3 * (1 + (args[0].shape[1] - 1) / 20) + self.extra_s


@pytest.fixture
def clock(monkeypatch):
    from types import SimpleNamespace

    import verispec.generate as engine

    modelled = ModelledClock()
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: modelled.now))
    handle = torch.nn.modules.module.register_module_forward_pre_hook(modelled.pass_hook)
    yield modelled
    handle.remove()
