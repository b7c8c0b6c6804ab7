"""Caches kept in 16 bits (`load_model(kv_cache=...)`, `--kv-cache`): every path reads them,
each key and value is rounded once as it is written, and speculation still changes nothing."""

from __future__ import annotations

import pytest
import torch

import tiny
from verispec import kernels
from verispec.cache import CACHE_DTYPES
from verispec.errors import VerispecError
from verispec.generate import generate
from verispec.loading import load_model
from verispec.quant import KERNEL_MAX_ROWS

needs_kernels = pytest.mark.skipif(kernels.cpu_kernels() is None, reason="the CPU kernels need AVX2 or AVX-512")
IDS = torch.tensor([[5, 77, 100, 3, 9, 200, 42, 17, 61, 2, 8, 90]])
PROMPT = "the cache keeps"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny.save_hf_model(path, "qwen2", seed=3)
    return path


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, model.new_cache(ids.shape[1] + 1))


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_a_16_bit_cache_keeps_a_pass_bit_identical_to_steps(folder, fmt, kv):
    loaded = load_model(folder, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt, kv_cache=kv)
    assert loaded.kv_cache == kv and loaded.model.new_cache(4).k.dtype == CACHE_DTYPES[kv]
    one_pass, steps = tiny.pass_and_steps(loaded.model, IDS, prefix=3)
    assert torch.equal(one_pass, steps)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_16_bit_cache_rounds_keys_and_values_and_no_more(folder, fmt):
    """The logits move by the rounding of the cached keys and values: a little, not nothing."""
    exact = _logits(load_model(folder, weights=fmt).model, IDS)
    for kv, tolerance in (("bfloat16", 0.05), ("float16", 0.01)):
        rounded = _logits(load_model(folder, weights=fmt, kv_cache=kv).model, IDS)
        difference = (rounded - exact).abs().max().item()
        assert 0 < difference < tolerance * exact.abs().max().item(), (kv, difference)


@needs_kernels
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_pytorch_attention_reads_a_16_bit_cache_as_the_kernels_do(folder, kv):
    """Off the fast path, a prompt longer than the kernels take goes through PyTorch's attention
    over the same 16-bit cache: it gives the kernels' logits within float rounding, and the step
    after it, on the kernels again, reads what it wrote."""
    model = load_model(folder, weights="int8", kv_cache=kv).model
    ids = torch.randint(0, 250, (1, KERNEL_MAX_ROWS + 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model.new_cache(ids.shape[1] + 1)
        kernels_prompt = model(ids[:, :-1], cache)[:, -1]
        kernels_step = model(ids[:, -1:], cache)[:, -1]
        fast_path, model.fast_path = model.fast_path, None
        try:
            cache = model.new_cache(ids.shape[1] + 1)
            pytorch_prompt = model(ids[:, :-1], cache)[:, -1]
        finally:
            model.fast_path = fast_path
        assert cache.k.dtype == CACHE_DTYPES[kv]
        step = model(ids[:, -1:], cache)[:, -1]
    scale = kernels_prompt.abs().max().item()
    torch.testing.assert_close(pytorch_prompt, kernels_prompt, rtol=0, atol=2e-3 * scale)
    torch.testing.assert_close(step, kernels_step, rtol=0, atol=2e-3 * scale)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_speculation_over_16_bit_caches_changes_nothing(folder, tmp_path, kv):
    target = load_model(folder, weights="int8", kv_cache=kv)
    tiny.save_hf_model(tmp_path, "qwen2", seed=9, num_hidden_layers=1)
    unrelated = load_model(tmp_path, weights="int4", kv_cache=kv)
    baseline = generate(target, PROMPT, max_tokens=30, ignore_eos=True)
    for draft in (target, unrelated, "ngram"):
        for gamma in (1, 4):
            result = generate(target, PROMPT, draft=draft, gamma=gamma, max_tokens=30, ignore_eos=True)
            assert result.token_ids == baseline.token_ids


def test_a_16_bit_cache_holds_half_the_bytes(folder):
    full = load_model(folder, weights="int8").model.new_cache(128)
    half = load_model(folder, weights="int8", kv_cache="bfloat16").model.new_cache(128)
    assert full.k.dtype == torch.float32 and half.nbytes() * 2 == full.nbytes()


def test_an_unknown_cache_type_is_a_clear_error(folder):
    with pytest.raises(VerispecError, match="unknown KV cache type 'int8'; choose from float32, bfloat16, float16"):
        load_model(folder, weights="int8", kv_cache="int8")


def test_the_command_line_takes_a_cache_type(folder, capsys, monkeypatch):
    import json

    import verispec.loading
    from verispec.cli import main

    loaded, original = [], verispec.loading.load_model

    def load_model_and_note(*args, **kwargs):
        loaded.append(original(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(verispec.loading, "load_model", load_model_and_note)
    args = ["generate", "--model", str(folder), "--draft", str(folder), "--weights", "int8", "--draft-weights", "int4",
            "-n", "12", "--ignore-eos", "--json"]
    assert main([*args, "--kv-cache", "bfloat16", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 12
    assert [m.kv_cache for m in loaded] == ["bfloat16", "bfloat16"]  # the target's and the draft's
    assert main([*args, PROMPT]) == 0
    assert [m.kv_cache for m in loaded[2:]] == ["float32", "float32"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--kv-cache", "int8", PROMPT])
    assert exit_info.value.code == 2 and "--kv-cache" in capsys.readouterr().err


def test_the_benchmark_times_every_cache_type_at_a_fixed_context(folder, monkeypatch):
    """benchmarks/kv_cache.py fills a cache of each type to the context asked for and rolls
    each timed pass back, so that every timing sees the same context."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import kv_cache

    model = load_model(folder, weights="int8").model
    for name in kv_cache.CACHE_TYPES:
        cache = kv_cache.filled_cache(model, CACHE_DTYPES[name], context=40, extra=5)
        assert cache.k.dtype == CACHE_DTYPES[name] and cache.length == 40 and cache.k[:, :, :, :40].abs().sum() > 0
        assert kv_cache.step_timer(model, cache, 40, 5, repeats=2)() > 0 and cache.length == 40
