"""A draft limited to the first token ids: its output layer computes only their logits, and
speculation stays exact."""

from __future__ import annotations

import pytest
import torch

import tiny
from verispec import kernels
from verispec.errors import VerispecError
from verispec.generate import generate
from verispec.quant import FORMATS

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny.save_hf_model(path, "qwen2", seed=5)
    return path


_load = tiny.load_as


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize("outputs", [64, 100, 261])
def test_the_first_outputs_are_the_whole_logits_first_columns(folder, fmt, fast, outputs):
    kernels.set_enabled(fast)
    try:
        model = _load(folder, fmt).model
        assert (model.fast_path is not None and model.fast_path.applies(torch.zeros(1, 1), model.new_cache(1))) == (
            fast and kernels.cpu_kernels() is not None)
        ids = torch.tensor([[5, 77, 100, 3, 9, 200, 42]])
        with torch.inference_mode():
            cache = model.new_cache(16)
            whole = model(ids, cache)
            cache.rollback(0)
            first = model(ids, cache, outputs=outputs)
            cache.rollback(5)
            step_whole = model(ids[:, 5:6], cache, last_only=True)
            cache.rollback(5)
            step = model(ids[:, 5:6], cache, last_only=True, outputs=outputs)
    finally:
        kernels.set_enabled(True)
    assert first.shape == (1, 7, outputs) and step.shape == (1, 1, outputs)
    assert torch.equal(first, whole[..., :outputs])
    assert torch.equal(step, step_whole[..., :outputs])


@pytest.mark.parametrize("fmt", ["int4", "float32"])
def test_speculation_with_a_limited_draft_is_the_targets_output(folder, fmt):
    target = _load(folder, fmt)
    plain = generate(target, PROMPT, max_tokens=32, ignore_eos=True)
    limit = sorted(plain.token_ids)[len(plain.token_ids) // 2] + 1  # some of the target's tokens lie above it
    limited = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True, draft_vocab=limit)
    whole = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True)
    assert limited.token_ids == plain.token_ids == whole.token_ids
    drafted = [t for t, kind in zip(limited.token_ids, limited.origins) if kind == "draft"]
    assert drafted and max(drafted) < limit
    assert limited.spec.acceptance_rate < whole.spec.acceptance_rate == 1.0


def test_sampling_with_a_limited_draft_decodes(folder):
    target = _load(folder, "int8")
    result = generate(target, PROMPT, draft=target, gamma=3, max_tokens=24, ignore_eos=True, temperature=0.8,
                      seed=1, draft_vocab=128)
    assert len(result.token_ids) == 24
    drafted = [t for t, kind in zip(result.token_ids, result.origins) if kind == "draft"]
    assert all(t < 128 for t in drafted)


@pytest.mark.parametrize("value", [0, -3, 2.5, "many"])
def test_a_bad_draft_vocabulary_is_a_clear_error(folder, value):
    target = _load(folder, "int8")
    with pytest.raises(VerispecError, match="draft vocabulary"):
        generate(target, PROMPT, draft=target, max_tokens=4, draft_vocab=value)


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_draft_vocabulary_without_a_draft_model_is_a_clear_error(folder, draft):
    target = _load(folder, "int8")
    with pytest.raises(VerispecError, match="applies to a draft model only"):
        generate(target, PROMPT, draft=draft, max_tokens=4, draft_vocab=64)


def test_the_command_line_takes_a_draft_vocabulary(folder, capsys):
    from verispec.cli import main

    args = ["generate", "--model", str(folder), "--draft", str(folder), "--weights", "int4", "--draft-weights", "int4",
            "-n", "12", "--ignore-eos", "--json", PROMPT]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args[:-1], "--draft-vocab", "100", PROMPT]) == 0
    limited = capsys.readouterr().out
    import json

    assert json.loads(limited)["token_ids"] == json.loads(whole)["token_ids"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args[:-1], "--draft-vocab", "0", PROMPT])
    assert exit_info.value.code == 2 and "--draft-vocab" in capsys.readouterr().err
