"""The fast paths: every weight format decodes, the kernels give the plain path's greedy tokens,
a verification pass equals single steps bit for bit, GGUF 4-bit blocks repack exactly,
the weight cache round-trips, and the GPU benchmark runs (on the CPU, at toy sizes)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from verispec import kernels
from verispec.generate import generate
from verispec.loading import load_model
from verispec.quant import (FORMATS, FloatLinear, Int4Linear, Int8Linear, PackedLinear, from_panels, fuse,
                            int4_from_gguf, int4_from_panels, int4_to_float, round_activations, to_panels,
                            weight_bytes)

PROMPT = "the cat sat on the mat. the cat"
REPO = Path(__file__).resolve().parents[1]

needs_kernels = pytest.mark.skipif(kernels.cpu_kernels() is None, reason="the CPU kernels could not be built")


def test_the_kernels_build_where_the_processor_can_run_them():
    """The kernels need AVX2 (or AVX-512): their source refuses to compile without it, and
    verispec then runs PyTorch's ops. The kernel tests skip where there is no module, so on
    Linux with such a processor a missing module is a failed build, and fails here; without
    one there is no module. Elsewhere a build may also lack a compiler, never the AVX2."""
    built = kernels.cpu_kernels() is not None
    capable = kernels.enabled() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if sys.platform == "linux":
        assert built == capable, ("the CPU kernels failed to build: see the warning above" if capable
                                  else "the CPU kernels built for a processor without AVX2")
    else:
        assert capable or not built


def test_the_kernels_switched_off_for_a_block_come_back_as_they_were():
    assert kernels.enabled()
    with kernels.switched_off():
        assert not kernels.enabled()
        with kernels.switched_off():
            assert not kernels.enabled()
        assert not kernels.enabled()  # an inner block leaves them off for the outer one
    assert kernels.enabled()
    with pytest.raises(RuntimeError), kernels.switched_off():
        raise RuntimeError
    assert kernels.enabled()


@needs_kernels
def test_the_softmax_kernel_is_torchs_softmax_at_a_temperature():
    """softmax_ (the sampler's warp without top-k) on rows of any length, in place: torch's
    softmax to float32 rounding; ids more than 87 below the maximum after the scale, and -inf
    ones, exactly 0."""
    compiled = kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(4)
    for columns in (2, 7, 8, 17, 4099):
        for scale in (0.5, 1 / 0.7, 20.0):
            logits = 4 * torch.randn(3, columns, generator=generator)
            logits[0, 0] = float("-inf")
            got = logits.clone()
            compiled.softmax_(got, scale)
            scaled = logits * torch.tensor(scale, dtype=torch.float32)  # rounded as the kernel rounds it
            assert torch.allclose(got, torch.softmax(scaled, -1), rtol=1e-5, atol=1e-37)
            below = (scaled - scaled.max(-1, keepdim=True).values) < -87
            assert torch.equal(got == 0, below) and torch.all(got[~below] > 0)


@needs_kernels
def test_the_top_k_kernel_is_a_softmax_over_the_k_largest():
    """top_k_ (the sampler's warp with top-k) on rows of any length: torch's softmax over the
    ids of at least the k-th largest scaled logit, ties with it kept, every other id exactly 0;
    -inf logits stay impossible; k may be the whole row or one id."""
    compiled = kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(6)
    for columns in (7, 16, 61, 5003):
        for k in sorted({1, 3, min(50, columns), columns}):
            for scale in (1.0, 1 / 0.7):
                logits = 4 * torch.randn(3, columns, generator=generator)
                logits[0, 1] = float("-inf")
                logits[1, :6] = logits[1].max() + 1  # six ties at the top: k of 1 or 3 keeps all six
                got = logits.clone()
                compiled.top_k_(got, scale, k)
                scaled = logits * torch.tensor(scale, dtype=torch.float32)
                kth = scaled.topk(k, -1).values[:, -1:]
                expected = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1)
                assert torch.equal(got > 0, expected > 0), (columns, k, scale)
                assert torch.allclose(got, expected, rtol=1e-5, atol=0)
                if k < 6:
                    assert int((got[1] > 0).sum()) == 6  # the tied ids all stay
                assert got[0, 1] == 0
    with pytest.raises(RuntimeError, match="k must be"):
        compiled.top_k_(torch.zeros(1, 5), 1.0, 6)


@needs_kernels
@pytest.mark.parametrize("shape", ["peaked", "middle", "flat", "ties"])
def test_the_nucleus_kernel_keeps_what_the_numpy_nucleus_keeps(shape):
    """nucleus_ (top-p after the kernels' softmax) against sampling._keep_nucleus on the same
    probabilities: the same ids kept, for a nucleus of a few ids (above the first floor), of
    ids between 1e-5 and 1e-3, of every id (flat rows: no floor holds top_p), and of tied ids at
    its edge; their probabilities renormalised alike, every other id exactly 0."""
    from verispec.sampling import NUCLEUS_FLOORS, _keep_nucleus

    compiled = kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(5)
    columns = 5003
    logits = {"peaked": 6 * torch.randn(3, columns, generator=generator),
              "middle": 0.05 * torch.randn(3, columns, generator=generator) + torch.tensor([0.0, 3.0, 6.0])[:, None] * (
                  torch.arange(columns) < 40),
              "flat": 1e-3 * torch.randn(3, 150_000, generator=generator),  # each id under 1e-5
              "ties": torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -2.0] * 3]).repeat(3, 1)}[shape]
    probs = torch.softmax(logits, -1)
    if shape == "middle":
        assert 1e-5 < probs[0].min() and probs[0].max() < 1e-3  # every id between the floors
    if shape == "flat":
        assert probs.max() < 1e-5
    for top_p in (0.05, 0.5, 0.9, 0.97, 0.999):
        got = probs.clone()
        compiled.nucleus_(got, top_p, NUCLEUS_FLOORS)
        expected = probs.clone().numpy()
        for row in expected:
            _keep_nucleus(row, top_p)
        expected = torch.from_numpy(expected)
        assert torch.equal(got > 0, expected > 0), (shape, top_p)
        assert torch.allclose(got, expected, rtol=1e-6, atol=0)
        assert torch.allclose(got.sum(-1), torch.ones(3))
        assert torch.all((got > 0).sum(-1) >= 1)
    with pytest.raises(RuntimeError, match="top_p"):
        compiled.nucleus_(probs.clone(), 0.0, NUCLEUS_FLOORS)
    with pytest.raises(RuntimeError, match="last floor"):
        compiled.nucleus_(probs.clone(), 0.9, [1e-3])


@contextlib.contextmanager
def _plain_path(as_int4_kernel: bool = False):
    """PyTorch's path instead of the kernels. With `as_int4_kernel`, int4 layers that run on
    the int4 panel kernel (those in its panel layout) first round their activations to int8 as that
    kernel does, so the two paths compute the same function and differ only in float32
    rounding; elsewhere this changes nothing."""
    patch = pytest.MonkeyPatch()
    if as_int4_kernel:
        exact = Int4Linear.torch_product
        patch.setattr(Int4Linear, "torch_product",
                      lambda self, rows: exact(self, round_activations(rows) if self.panels is not None else rows))
    try:
        with kernels.switched_off():
            yield
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny.save_hf_model(path, "qwen2", seed=3)
    return path


_load = tiny.load_as


def _plain_reference(folder, fmt):
    """The same weights on the PyTorch path. bfloat16 weights run in float32 on the fast
    path, so their reference is the float32 model with every weight rounded to bfloat16."""
    with kernels.switched_off():
        if fmt != "bfloat16":
            return _load(folder, fmt)
        reference = load_model(folder)
        with torch.no_grad():
            for p in reference.model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        return reference


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_and_matches_the_plain_path(folder, fmt):
    loaded = _load(folder, fmt)
    assert loaded.model.fast_path is not None
    fast = generate(loaded, PROMPT, max_tokens=24, ignore_eos=True)
    reference = _plain_reference(folder, fmt)
    with _plain_path(as_int4_kernel=True):
        plain = generate(reference if fmt == "bfloat16" else loaded, PROMPT, max_tokens=24, ignore_eos=True)
    assert len(fast.token_ids) == 24
    assert fast.token_ids == plain.token_ids


@needs_kernels
def test_a_long_prompt_goes_through_in_slices(folder):
    model = _load(folder, "int4").model
    ids = (torch.arange(150).view(1, -1) * 7) % 250
    with torch.inference_mode():
        whole = model(ids, model.new_cache(160))
        cache = model.new_cache(160)
        last = model(ids, cache, last_only=True)
        assert cache.length == 150
        steps = model.new_cache(160)
        model(ids[:, :149], steps)
        step = model(ids[:, 149:], steps)
    assert whole.shape == (1, 150, model.config.vocab_size)
    assert torch.equal(last[0, -1], whole[0, -1]) and torch.equal(step[0, -1], whole[0, -1])


@needs_kernels
@pytest.mark.parametrize("hq,hkv", [(12, 2), (32, 2), (6, 3), (4, 4)])
def test_attention_reads_a_groups_keys_once_with_the_same_bits_as_head_by_head(hq, hkv):
    """On one thread the query heads sharing a key/value head go through the cache together
    (up to 64 chains of a head and a position, in tiles of several chains and keys, or key by
    key); with more threads than such groups, head by head. Both give the same bits, and the
    attention of a plain reference (no rotation: cos 1, sin 0). The values are weighed in tiles of
    16 KB of the cache (64 positions here), so the longer contexts span several."""
    _check_attention(kernels.cpu_kernels(), hq, hkv)


def _check_attention(k, hq: int, hkv: int) -> None:
    """Both ways the cache is read: fetched by the hardware alone (AMD's default; a few chains
    then go key by key) and fetched ahead in software (Intel's)."""
    default_ahead = k.attention_prefetch()
    try:
        for ahead in (0, 1536):
            k.set_attention_prefetch(ahead)
            _check_attention_cases(k.attention, hq, hkv)
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_attention_prefetch(100)
    finally:
        k.set_attention_prefetch(default_ahead)
    assert default_ahead in (0, 1536)  # Intel: 1.5 KB; elsewhere the hardware alone


def _check_attention_cases(attention, hq: int, hkv: int) -> None:
    generator = torch.Generator().manual_seed(hq)
    d = 64
    for m, window, start in [(1, 0, 37), (5, 0, 37), (3, 20, 37), (1, 0, 300), (5, 0, 300), (2, 150, 300)]:
        k = torch.randn(hkv, start + m, d, generator=generator)
        v = torch.randn(hkv, start + m, d, generator=generator)
        qkv = torch.randn(m, (hq + 2 * hkv) * d, generator=generator)
        cos, sin = torch.ones(m, d), torch.zeros(m, d)
        outputs = []
        threads = torch.get_num_threads()
        for count in (1, 4 * hkv * m):
            torch.set_num_threads(count)
            kc, vc = k.clone(), v.clone()
            outputs.append(attention(qkv, kc, vc, cos, sin, start, hq, hkv, window, None, None, 1e-6))
        torch.set_num_threads(threads)
        assert torch.equal(outputs[0], outputs[1])
        q = qkv[:, :hq * d].view(m, hq, d).transpose(0, 1)
        keys = kc.repeat_interleave(hq // hkv, dim=0)  # kc holds the new keys too
        values = vc.repeat_interleave(hq // hkv, dim=0)
        positions = torch.arange(start + m)
        now = start + torch.arange(m)[:, None]
        allowed = (positions <= now) & ((positions > now - window) if window else True)
        scores = (q @ keys.transpose(1, 2)) / d ** 0.5
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        expected = (weights @ values).transpose(0, 1).reshape(m, hq * d)
        torch.testing.assert_close(outputs[0], expected, rtol=1e-5, atol=1e-5)
        # and a pass gives each row the bits of a step over its own positions alone: its
        # later rows' own keys are scored one at a time, a step's in tiles of keys
        kc, vc = k.clone(), v.clone()
        steps = [attention(qkv[i:i + 1], kc, vc, cos[i:i + 1], sin[i:i + 1], start + i, hq, hkv, window,
                           None, None, 1e-6) for i in range(m)]
        assert torch.equal(outputs[0], torch.cat(steps))


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pass_over_many_positions_equals_single_steps_bit_for_bit(folder, fmt):
    model = _load(folder, fmt).model
    ids = torch.tensor([[5, 77, 100, 3, 9, 200, 42, 17, 61, 2, 8]])
    with torch.inference_mode():
        cache = model.new_cache(32)
        model(ids[:, :3], cache)
        one_pass = model(ids[:, 3:], cache)
        cache.rollback(3)
        steps = torch.cat([model(ids[:, i:i + 1], cache) for i in range(3, ids.shape[1])], dim=1)
    assert torch.equal(one_pass, steps)


@needs_kernels
def test_int4_speculation_changes_nothing(folder, tmp_path):
    target = _load(folder, "int4")
    tiny.save_hf_model(tmp_path, "qwen2", seed=9, num_hidden_layers=1)
    unrelated = _load(tmp_path, "int4")
    baseline = generate(target, PROMPT, max_tokens=30, ignore_eos=True)
    for draft in (target, unrelated):
        for gamma in (1, 4, 9):
            result = generate(target, PROMPT, draft=draft, gamma=gamma, max_tokens=30, ignore_eos=True)
            assert result.token_ids == baseline.token_ids
    assert generate(target, PROMPT, draft=target, gamma=4, max_tokens=30, ignore_eos=True).spec.acceptance_rate == 1.0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_formats_decode_without_the_kernels(folder, fmt):
    loaded = _load(folder, fmt)
    ids = torch.tensor([[5, 77, 100, 3, 9]])
    with torch.inference_mode():
        with _plain_path():
            result = generate(loaded, PROMPT, max_tokens=16, ignore_eos=True)
            plain = loaded.model(ids, loaded.model.new_cache(8))
        fast = loaded.model(ids, loaded.model.new_cache(8))
        with _plain_path(as_int4_kernel=True):
            same_function = loaded.model(ids, loaded.model.new_cache(8))
    assert len(result.token_ids) == 16
    if kernels.cpu_kernels() is not None:
        scale = fast.abs().max()
        assert (same_function - fast).abs().max() <= 1e-3 * scale  # float32 rounding only
        # Rounding activations to int8 (the int4 panel kernel) moves each product by up to
        # max|x| / 254 per group times the weights' sum; through the tiny model's layers
        # the logits moved by 1.8% of the largest one when this was written. A layout or
        # scale mistake moves them by about 100%.
        rounded = fmt == "int4" and hasattr(kernels.cpu_kernels(), "linear_int4_panels")
        assert (plain - fast).abs().max() <= (4e-2 if rounded else 1e-3) * scale


def _int4_layer(rows: int, cols: int, seed: int = 0) -> tuple[Int4Linear, torch.Tensor, torch.Tensor]:
    """A random int4 layer with bias, and rows of activations with a few large outliers, as LLMs have."""
    gen = torch.Generator().manual_seed(seed)
    layer = Int4Linear.from_float(torch.randn(rows, cols, generator=gen), torch.randn(rows, generator=gen))
    x = torch.randn(12, cols, generator=gen)
    x = x * torch.where(torch.rand(12, cols, generator=gen) < 0.03, 20.0, 1.0)
    return layer, x, torch.randn(12, rows, generator=gen)


@needs_kernels
def test_int4_panel_kernel_is_the_product_with_int8_rounded_activations():
    k = kernels.cpu_kernels()
    layer, x, residual = _int4_layer(48, 256)
    nibbles, scales, weight = layer.nibbles, layer.scales, layer.dense_weight()
    panels = k.int4_to_panels(nibbles, scales)
    # the panel layout holds the same weights
    assert [torch.equal(a, b) for a, b in zip(int4_from_panels(panels), (nibbles, scales))] == [True, True]
    assert torch.equal(k.dequantize_int4_panels(panels), weight)
    vnni = k.linear_int4_panels(x, panels, layer.bias, residual).double()
    # the activations as the kernel rounds them: within half a step of dx = max|x| / 127
    rounded = round_activations(x)
    step = x.reshape(12, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((rounded - x).reshape(12, -1, 32).abs() <= step / 2 * (1 + 1e-6)).all())
    # exactly the int4 weights times those activations, up to float32 rounding
    w, b, r = weight.double(), layer.bias.double(), residual.double()
    exact_rounded = rounded.double() @ w.T + b + r
    magnitude = rounded.double().abs() @ w.abs().T + b.abs() + r.abs()
    assert bool(((vnni - exact_rounded).abs() <= 1e-5 * magnitude).all())
    # and the float32 int4 kernel agrees with it to within what rounding x can change:
    # |sum w (x - rounded)| <= sum |w| |x - rounded|
    plain = k.linear_int4(x, nibbles, scales, layer.bias, residual).double()
    bound = (x - rounded).double().abs() @ w.abs().T
    assert bool(((vnni - plain).abs() <= bound + 1e-5 * magnitude).all())
    assert (vnni - plain).abs().max() > 0  # the activations really were rounded


@needs_kernels
def test_int4_panel_rows_are_bit_identical_to_single_rows():
    k = kernels.cpu_kernels()
    layer, x, residual = _int4_layer(64, 96, seed=1)
    panels = k.int4_to_panels(layer.nibbles, layer.scales)
    x, residual = torch.cat([x, x[:9] * 0.5]), torch.cat([residual, residual[:9]])  # 21 rows: three tiles
    singles = torch.cat([k.linear_int4_panels(x[i:i + 1], panels, layer.bias, residual[i:i + 1])
                         for i in range(21)])
    for m in [*range(1, 13), 21]:
        assert torch.equal(k.linear_int4_panels(x[:m], panels, layer.bias, residual[:m].contiguous()), singles[:m])


@needs_kernels
def test_integer_panels_do_not_overflow_at_the_largest_weights_and_activations():
    """Without VNNI the int4 product sums a group's byte pairs in 16 bits, and the int8 one
    multiplies 16-bit pairs: the largest nibbles (15) times activations that round to ±127,
    and the largest int8 weights times ±32767, must still give the exact sums."""
    k = kernels.cpu_kernels()
    n, cols = 32, 256
    nibbles = torch.full((n, cols // 2), 0xFF, dtype=torch.uint8)
    scales = torch.zeros(n, cols // 32, 2, dtype=torch.float16)
    scales[..., 0] = 1.0
    int4_panels = k.int4_to_panels(nibbles, scales)
    int8_weight = torch.full((n, cols), 127, dtype=torch.int8)
    int8_weight[:, 1::2] = -127  # pairs of opposite weights: each 16-bit pair sums to 0
    int8_weight[: n // 2] = 127  # half the columns all at +127
    int8_panels = to_panels(int8_weight)
    ones = torch.ones(n)
    for sign in (1.0, -1.0):
        x = torch.full((3, cols), sign)
        expected4 = torch.full((3, n), sign * 15.0 * cols)
        torch.testing.assert_close(k.linear_int4_panels(x, int4_panels, None, None), expected4, rtol=1e-5, atol=0)
        expected8 = torch.cat([torch.full((3, n // 2), sign * 127.0 * cols), torch.zeros(3, n // 2)], 1)
        torch.testing.assert_close(k.linear_int8_panels(x, int8_panels, ones, None, None), expected8,
                                   rtol=1e-5, atol=1e-3)


@needs_kernels
def test_int4_layers_switch_to_the_panel_layout_once_and_keep_the_canonical_one_outside():
    layer, x, _ = _int4_layer(48, 64)
    odd, _, _ = _int4_layer(40, 64)  # not a multiple of 16 columns: stays on the float32 kernel
    nibbles, scales, weight = layer.nibbles.clone(), layer.scales.clone(), layer.dense_weight()
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    y = layer(x[:3])
    odd(x[:3])
    assert layer.panels is not None and layer.nibbles is None and odd.panels is None
    assert weight_bytes(layer) == nibbles.numel() + scales.numel() * 2 + layer.bias.numel() * 4
    assert torch.equal(layer.dense_weight(), weight)
    saved = layer.state_dict()
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[n], state[n]) for n in state)
    fused = fuse([layer, odd])
    assert torch.equal(fused.dense_weight(), torch.cat([weight, odd.dense_weight()]))
    with _plain_path():  # the PyTorch path stays the exact product
        assert torch.allclose(layer(x[:3]), x[:3] @ weight.T + layer.bias, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x[:3]), y)
    layer.load_state_dict(state)  # loading the canonical layout works in either layout
    assert layer.panels is None and torch.equal(layer.nibbles, nibbles)
    assert torch.equal(layer(x[:3]), y)


def _rows(cols: int, seed: int, count: int = 21) -> torch.Tensor:
    """Activations with a few large outliers, as LLMs have; 21 rows make three 10-row tiles."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, cols, generator=gen)
    return x * torch.where(torch.rand(count, cols, generator=gen) < 0.03, 20.0, 1.0)


def _assert_rows_match_single_rows(product, x: torch.Tensor, residual: torch.Tensor) -> None:
    singles = torch.cat([product(x[i:i + 1], residual[i:i + 1]) for i in range(x.shape[0])])
    for m in [*range(1, 13), x.shape[0]]:
        assert torch.equal(product(x[:m], residual[:m].contiguous()), singles[:m]), m


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_panel_kernel_is_the_same_product_and_batch_invariant(dtype):
    k = kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(48, 96, generator=gen).to(dtype), torch.randn(48, generator=gen)
    x, residual = _rows(96, seed=5), torch.randn(21, 48, generator=gen)
    panels = to_panels(weight)
    assert panels.shape == (3, 96 * weight.element_size() // 4, 16, 4 // weight.element_size())
    assert torch.equal(from_panels(panels), weight)
    y = k.linear_float_panels(x, panels, bias, residual).double()
    w = weight.double()
    exact = x.double() @ w.T + bias.double() + residual.double()
    magnitude = x.double().abs() @ w.abs().T + bias.double().abs() + residual.double().abs()
    assert bool(((y - exact).abs() <= 1e-5 * magnitude).all())
    _assert_rows_match_single_rows(lambda rows, res: k.linear_float_panels(rows, panels, bias, res), x, residual)


@needs_kernels
def test_int8_panel_kernel_is_the_product_with_16_bit_activations():
    k = kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(6)
    layer = Int8Linear.from_float(torch.randn(64, 256, generator=gen), torch.randn(64, generator=gen))
    x, residual = _rows(256, seed=7), torch.randn(21, 64, generator=gen)
    panels = to_panels(layer.weight)
    assert torch.equal(from_panels(panels), layer.weight)
    y = k.linear_int8_panels(x, panels, layer.scale, layer.bias, residual).double()
    # the activations as the kernel rounds them: within half a step of dx = max|x| / 32767
    # (and float32's rounding of q * dx, which at this step size is visible)
    rounded = round_activations(x, levels=32767)
    groups = x.reshape(21, -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 32767
    assert bool(((rounded.reshape(21, -1, 32) - groups).abs() <= step / 2 + 2.5e-7 * groups.abs()).all())
    # exactly the int8 weights times those activations, up to float32 rounding
    w, b, r = layer.dense_weight().double(), layer.bias.double(), residual.double()
    exact_rounded = rounded.double() @ w.T + b + r
    magnitude = rounded.double().abs() @ w.abs().T + b.abs() + r.abs()
    assert bool(((y - exact_rounded).abs() <= 1e-5 * magnitude).all())
    # so it differs from the weight-only product by no more than the rounding can move it
    exact = x.double() @ w.T + b + r
    bound = (x - rounded).double().abs() @ w.abs().T
    assert bool(((y - exact).abs() <= bound + 1e-5 * magnitude).all())
    _assert_rows_match_single_rows(
        lambda rows, res: k.linear_int8_panels(rows, panels, layer.scale, layer.bias, res), x, residual)


@needs_kernels
def test_the_prefetch_distance_changes_speed_only():
    k = kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(12)
    layer = Int8Linear.from_float(torch.randn(4096, 256, generator=gen))  # several 20 KB streams
    panels, x = to_panels(layer.weight), _rows(256, seed=13, count=5)
    floats = to_panels(torch.randn(2048, 256, generator=gen))
    default, default_pass = k.stream_prefetch(), k.pass_stream_prefetch()
    try:
        results = []
        for distance in (default, 0, 64, 4096):
            k.set_stream_prefetch(distance)
            k.set_pass_stream_prefetch(distance)  # the 5-row passes read one stream where pairs stop short of them
            results.append((k.linear_int8_panels(x, panels, layer.scale, None, None),
                            k.linear_float_panels(x, floats, None, None)))
        assert all(torch.equal(a, results[0][0]) and torch.equal(b, results[0][1]) for a, b in results)
        for setter in (k.set_stream_prefetch, k.set_pass_stream_prefetch):
            with pytest.raises(RuntimeError, match="multiple of 64"):
                setter(100)
    finally:
        k.set_stream_prefetch(default)
        k.set_pass_stream_prefetch(default_pass)
    assert k.stream_prefetch() == default == 20 * 1024
    assert default_pass in (4096, 2048, default)  # Zen 4: 4 KB; Zen 3: 2 KB; elsewhere as far as one-row streams


def _products_of_111_panels(seed: int, k=None) -> tuple[list, int]:
    """Products of 111 panels (two regions per thread, of odd and even length) in int8, int4,
    float32 and bfloat16, with and without bias, as (x, residual) -> y, and their output width;
    on the kernels `k` (the usual build if None)."""
    k = k or kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(seed)
    n = 16 * 111
    int8 = Int8Linear.from_float(torch.randn(n, 256, generator=gen), torch.randn(n, generator=gen))
    int4, _, _ = _int4_layer(n, 256, seed=seed + 1)
    panels8, panels4 = to_panels(int8.weight), k.int4_to_panels(int4.nibbles, int4.scales)
    floats = {dtype: to_panels(torch.randn(n, 256, generator=gen).to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    products = [lambda x, r: k.linear_int8_panels(x, panels8, int8.scale, int8.bias, r),
                lambda x, r: k.linear_int4_panels(x, panels4, int4.bias, r),
                *[lambda x, r, p=p: k.linear_float_panels(x, p, None, r) for p in floats.values()],
                lambda x, r: k.linear_float_panels(x, floats[torch.bfloat16], int8.bias, r)]
    return products, n


@needs_kernels
def test_one_row_products_read_by_region_give_the_rows_of_a_longer_pass():
    """A one-row product reads one region of panels per thread (as two streams side by side,
    or one): the very rows a three-row pass gives (111 panels: two regions, of odd and even
    length), however far ahead its streams are fetched into L1 and into L2."""
    k = kernels.cpu_kernels()
    products, n = _products_of_111_panels(seed=14)
    gen = torch.Generator().manual_seed(17)
    x, residual = _rows(256, seed=16, count=3), torch.randn(3, n, generator=gen)
    default, default_ahead, default_l2 = k.panel_streams(), k.pair_prefetch(), k.pair_l2_prefetch()
    try:
        # the last fetches far past the end; an L2 distance no further than L1's fetches nothing more
        for streams, ahead, l2 in ((1, 0, 0), (2, 0, 3072), (2, 64, 0), (2, 1536, 3072), (2, 1536, 1024),
                                   (2, 1 << 20, 1 << 21)):
            k.set_panel_streams(streams)
            k.set_pair_prefetch(ahead)
            k.set_pair_l2_prefetch(l2)
            for product in products:
                rows = product(x, residual)
                assert all(torch.equal(product(x[i:i + 1], residual[i:i + 1]), rows[i:i + 1]) for i in range(3))
        with pytest.raises(RuntimeError, match="1 or 2 streams"):
            k.set_panel_streams(3)
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_pair_prefetch(100)
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_pair_l2_prefetch(3000)
    finally:
        k.set_panel_streams(default)
        k.set_pair_prefetch(default_ahead)
        k.set_pair_l2_prefetch(default_l2)
    # Intel: both; the Zen 3: 1 KB into L1 alone; elsewhere neither
    assert default == 2 and (default_ahead, default_l2) in ((0, 0), (1536, 3072), (1024, 0))
    # the bandwidth reference reads the same ways, and is a sum every way
    t = torch.randn(1_000_003, generator=gen)
    exact = float(t[:t.numel() // 32 * 32].double().sum())
    for prefetch, streams, ahead in ((False, 1, -1), (True, 1, -1), (False, 2, -1), (True, 2, 512), (True, 1, 1536)):
        assert k.stream_sum(t, prefetch, streams, ahead) == pytest.approx(exact, abs=1e-2)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        k.stream_sum(t, True, 2, 100)


@needs_kernels
def test_products_split_between_threads_give_the_same_bits_whoever_reads_each_piece():
    """Each thread reads its own region from the front and then takes pieces from the back of
    the others', smaller near their ends: every panel is computed once, by whichever thread.
    Repeated, so that the pieces fall differently between the threads each time."""
    products, n = _products_of_111_panels(seed=21)
    gen = torch.Generator().manual_seed(22)
    x, residual = _rows(256, seed=23, count=1), torch.randn(1, n, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one region: nothing to take from another thread
        alone = [product(x, residual) for product in products]
        torch.set_num_threads(2)
        for _ in range(40):
            assert all(torch.equal(product(x, residual), y) for product, y in zip(products, alone))
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_what_helpers_read_ahead_of_a_product_changes_speed_only(folder):
    """While the calling thread does a layer's serial work, the helpers read the start of their
    regions of the next product: logits the same with none, the default, and more than a
    region holds (each read stops at its region's end)."""
    k = kernels.cpu_kernels()
    loaded = _load(folder, "int4")
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    default = k.helper_prefetch()
    try:
        logits = []
        for bytes_ in (0, default, 1 << 30):
            k.set_helper_prefetch(bytes_)
            steps = []
            cache = loaded.model.new_cache(8)
            for i in range(ids.shape[1]):  # one-row steps, the read-ahead's case
                steps.append(loaded.model(ids[:, i:i + 1], cache)[0])
            logits.append(torch.cat(steps))
        assert all(torch.equal(each, logits[0]) for each in logits)
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_helper_prefetch(1000)
    finally:
        k.set_helper_prefetch(default)
    assert default == 32 * 1024


@needs_kernels
def test_the_built_pair_tiles_fetch_their_streams_into_l1_and_l2():
    """Prefetches have no effect a test can see, and GCC once dropped every call to a helper
    that only prefetches (it counts a prefetch as no side effect). So read the built code: the
    pair tiles of one row, of a pass and of a pass read in blocks (int4, int8, float32) must
    hold fetches into L1 (prefetcht0) and L2 (prefetcht1), whatever processor the distances
    are set for. objdump comes with the binutils that assembled and linked the kernels, so
    wherever they build it is there."""
    assert shutil.which("objdump"), "objdump (binutils, which built the kernels) is not on the PATH"
    built = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", kernels.cpu_kernels().__file__],
                           capture_output=True, text=True, check=True).stdout
    # rows, panels, read in blocks: with AVX-512 a pair tile holds up to 8 integer rows and 3 float
    # rows, with AVX2's 16 registers one, and passes go through blocks one row at a time
    wide = kernels.cpu_kernels().lanes == 16
    integer_tiles = ("<1, 2, false>", "<5, 2, false>", "<8, 2, true>") if wide else ("<1, 2, false>", "<1, 2, true>")
    tiles = [f"::panel_tile{t}" for t in integer_tiles] + [f"::int8_panel_tile{t}" for t in integer_tiles]
    tiles += [f"::float_pair_steps<(anonymous namespace)::PanelF32, {rows}>" for rows in ((1, 3) if wide else (1,))]
    for name in tiles:
        body = next((part for part in built.split("\n\n") if name in part.split("\n", 1)[0]), None)
        assert body is not None, f"no {name} in the built kernels"
        assert "prefetcht0" in body and "prefetcht1" in body, f"{name} fetches nothing ahead"


@needs_kernels
def test_passes_read_as_pairs_of_panels_give_the_rows_of_single_steps(monkeypatch):
    """Passes of up to pair_rows(kind) rows (as many as the format reads as pairs) read two
    panels at a time, each thread's region as two streams (111 panels: an odd one out); float
    passes of more rows than one tile holds go through blocks of the panels in groups of rows.
    Every setting, and every distance passes of 5 rows or more fetch their pairs ahead, gives
    each row the bits of a one-row step, for every pass size up to beyond the most rows read
    as pairs, and each kind of panel keeps its own limit."""
    k = kernels.cpu_kernels()
    products, n = _products_of_111_panels(seed=21)
    x, residual = _rows(256, seed=23, count=17), torch.randn(17, n, generator=torch.Generator().manual_seed(24))
    singles = [torch.cat([product(x[i:i + 1], residual[i:i + 1]) for i in range(17)]) for product in products]
    defaults = {kind: k.pair_rows(kind) for kind in ("integer", "float")}
    default_ahead, default_l2, default_pass_l2 = k.pass_pair_prefetch(), k.pair_l2_prefetch(), k.pass_pair_l2_prefetch()
    k.set_pair_l2_prefetch(1024)
    pass_l2_after_one_row_l2_set = k.pass_pair_l2_prefetch()
    try:
        # passes of 5 rows or more fetch their pairs pass_pair_prefetch() ahead (the last far past the end),
        # and pairs pair_l2_prefetch() ahead into L2, integer passes of 5 rows or more in one tile pass_pair_l2_prefetch()
        for setting, ahead, l2, pass_l2 in ((1, 0, 0, 0), (2, 0, 0, 3072), (5, 1024, 3072, 0), (8, 0, 3072, 3072),
                                            (8, 1024, 0, 4096), (16, 1536, 3072, 0), (100, 1 << 20, 1 << 21, 1 << 21)):
            k.set_pair_rows(setting)
            k.set_pass_pair_prefetch(ahead)
            k.set_pair_l2_prefetch(l2)
            k.set_pass_pair_l2_prefetch(pass_l2)
            for product, single in zip(products, singles):
                for m in range(2, 18):
                    assert torch.equal(product(x[:m], residual[:m].contiguous()), single[:m])
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_pass_pair_prefetch(100)
        with pytest.raises(RuntimeError, match="multiple of 64"):
            k.set_pass_pair_l2_prefetch(100)
        k.set_pair_rows(3, "integer")
        assert (k.pair_rows("integer"), k.pair_rows("float")) == (3, 100)
        with pytest.raises(RuntimeError, match="at least 1"):
            k.set_pair_rows(0)
        with pytest.raises(RuntimeError, match="'integer' or 'float'"):
            k.set_pair_rows(4, "ints")
    finally:
        for kind, rows in defaults.items():
            k.set_pair_rows(rows, kind)
        k.set_pass_pair_prefetch(default_ahead)
        k.set_pair_l2_prefetch(default_l2)
        k.set_pass_pair_l2_prefetch(default_pass_l2)
    assert defaults in ({"integer": 1, "float": 1}, {"integer": 8, "float": 3}, {"integer": 16, "float": 16})
    assert default_ahead == (k.pair_prefetch() or 1024)  # Intel: as one-row products; elsewhere 1 KB
    # with AMX (the Xeon whose passes read faster without it) none; on the Zen 4 3 KB; elsewhere as far as one-row
    # products, even when those are set apart
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    cpu = importlib.import_module("perf_common").processor()
    amx = "amx_tile" in cpu["flags"]
    zen4 = cpu["vendor"] == "AuthenticAMD" and cpu["family"] == "25" and "avx512f" in cpu["flags"]
    expected = (0, 0) if amx else (3072, 3072) if zen4 else (default_l2, 1024)
    assert (default_pass_l2, pass_l2_after_one_row_l2_set) == expected
    # 16-bit float lines hold twice a float32 line's inputs: their passes fetch as passes from 3 rows
    assert [k.pass_pair_rows(w) for w in ("int4", "int8", "float32", "bfloat16", "float16")] == [5, 5, 5, 3, 3]
    with pytest.raises(RuntimeError, match="weights must be"):
        k.pass_pair_rows("q5_k")


def test_a_leftover_build_mark_is_cleared_only_while_no_build_runs(tmp_path):
    """Holding the build lock, a `lock` file in the folder is a leftover and goes; while another
    process holds the lock (a build in progress), the next one waits for it to let go."""
    leftover = tmp_path / "lock"
    leftover.touch()
    with kernels._one_build_at_a_time(tmp_path):
        assert not leftover.exists()
    holder = ("import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
              "print('held', flush=True); time.sleep(3)")
    with subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / "verispec.lock")],
                          stdout=subprocess.PIPE, text=True) as other:
        assert other.stdout.readline().strip() == "held"
        leftover.touch()  # the other process's build marks the folder
        asked = time.monotonic()
        with kernels._one_build_at_a_time(tmp_path):  # waits for the other to let go
            waited = time.monotonic() - asked
        assert other.wait() == 0
    assert waited > 2


@pytest.mark.skipif(kernels.cpu_kernels() is None, reason="no kernels on this machine")
def test_a_build_killed_midway_does_not_hang_the_next_start():
    """PyTorch marks a build in progress with a `lock` file in the build folder and waits while
    one is there; a build killed midway leaves it. The next start clears it and loads."""
    name = kernels.module_name(kernels._SOURCE, "verispec_cpu", kernels._FLAGS)
    folder = kernels.build_folder(name)
    leftover = folder / "lock"
    # Both under the build lock: a process loading the kernels meanwhile makes and removes its
    # own `lock` file while it holds that lock, so it neither meets this mark nor is mistaken for it.
    with kernels.build_lock(folder):
        leftover.touch()
    loads = "from verispec import kernels; assert kernels.compile_source(kernels._SOURCE) is not None"
    subprocess.run([sys.executable, "-c", loads], check=True, timeout=300)
    with kernels.build_lock(folder):
        assert not leftover.exists()


# On an AVX2 processor the usual build is the AVX2 one, and the tests above already run it;
# with AVX-512 they never do, so these build it apart.
needs_avx512 = pytest.mark.skipif(kernels.cpu_kernels() is None or torch.backends.cpu.get_cpu_capability() != "AVX512",
                                  reason="the usual build is the AVX2 one here (or there are no kernels)")


@pytest.fixture(scope="module")
def avx2_kernels():
    """The kernels built for AVX2 alone, on a processor with AVX-512."""
    return kernels.compile_source(kernels._SOURCE, prefix="verispec_avx2", extra_flags=["-mno-avx512f"])


@needs_avx512
@pytest.mark.parametrize("hq,hkv", [(12, 2), (32, 2)])
def test_the_avx2_build_attends_in_groups_with_the_bits_of_head_by_head(avx2_kernels, hq, hkv):
    _check_attention(avx2_kernels, hq, hkv)


@needs_avx512
def test_the_avx2_build_gives_passes_the_bits_of_single_steps_and_of_the_avx512_build(avx2_kernels):
    products, n = _products_of_111_panels(seed=21, k=avx2_kernels)
    usual, _ = _products_of_111_panels(seed=21)
    x, residual = _rows(256, seed=23, count=17), torch.randn(17, n, generator=torch.Generator().manual_seed(24))
    for product, reference in zip(products, usual):
        single = torch.cat([product(x[i:i + 1], residual[i:i + 1]) for i in range(17)])
        for m in range(2, 18):
            assert torch.equal(product(x[:m], residual[:m].contiguous()), single[:m]), m
        assert torch.equal(single, reference(x, residual))  # the panel kernels are written over 16 lanes on both


@needs_kernels
def test_reading_int8_panels_without_arithmetic_reads_every_byte():
    """The benchmarks' yardstick for the panel layout reads every line of every panel, on
    both threads' regions and an odd panel out (each output: an OR of its panel's lines)."""
    k = kernels.cpu_kernels()
    count, inputs = 131, 256  # 131 panels of 16 x 256: two regions, one of them odd
    panels = torch.randint(-128, 128, (count, inputs // 4, 16, 4), dtype=torch.int8,
                           generator=torch.Generator().manual_seed(17))
    seen = k.read_int8_panels(panels).view(torch.uint8).view(count, 64).numpy()
    lines = panels.view(torch.uint8).view(count, -1, 64).numpy()
    assert np.array_equal(seen, np.bitwise_or.reduce(lines, axis=1))


def _panel_layers(loaded) -> list[PackedLinear]:
    return [m for m in loaded.model.modules() if isinstance(m, PackedLinear) and m.panels is not None]


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8",
                                 "int4"])
def test_a_loaded_model_keeps_its_panels_in_one_buffer_in_the_order_they_run(folder, fmt, monkeypatch):
    loaded = _load(folder, fmt)
    layers = _panel_layers(loaded)
    # q/k/v, o, gate/up and down of every layer; the output layer too if its rows fill panels
    config = loaded.config
    assert len(layers) == 4 * config.num_hidden_layers + (config.vocab_size % 16 == 0)
    assert len({m.panels.untyped_storage().data_ptr() for m in layers}) == 1
    starts = [m.panels.data_ptr() for m in layers]
    ends = [m.panels.data_ptr() + m.panels.numel() * m.panels.element_size() for m in layers]
    assert all(start % 64 == 0 for start in starts)
    assert all(end <= start for end, start in zip(ends, starts[1:]))  # in module order, apart
    # the same panels and tokens as layers that switch one by one, on first use
    import verispec.quant
    monkeypatch.setattr(verispec.quant, "panels_in_one_buffer", lambda model, kernels: None)
    lazy = _load(folder, fmt)
    assert not _panel_layers(lazy)
    tokens = generate(lazy, PROMPT, max_tokens=12, ignore_eos=True).token_ids
    assert generate(loaded, PROMPT, max_tokens=12, ignore_eos=True).token_ids == tokens
    lazy_layers = _panel_layers(lazy)
    assert len(lazy_layers) == len(layers)
    assert all(torch.equal(a.panels, b.panels) for a, b in zip(layers, lazy_layers))
    assert len({m.panels.untyped_storage().data_ptr() for m in lazy_layers}) == len(layers)


def _layer(fmt: str, rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(rows, cols, generator=gen), torch.randn(rows, generator=gen)
    if fmt == "int8":
        return Int8Linear.from_float(weight, bias)
    return FloatLinear(weight.to(getattr(torch, fmt)), bias)


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_layers_switch_to_panels_once_and_keep_the_canonical_layout_outside(fmt):
    layer, odd = _layer(fmt, 48, 64, seed=8), _layer(fmt, 40, 64, seed=9)  # 40 columns: no panels
    weight, dense, size = layer.weight.clone(), layer.dense_weight(), weight_bytes(layer)
    state = {name: t.clone() for name, t in layer.state_dict().items()}
    x = _rows(64, seed=10, count=3)
    y = layer(x)
    odd(x)
    assert layer.panels is not None and layer.weight is None and odd.panels is None
    assert weight_bytes(layer) == size
    assert torch.equal(layer.dense_weight(), dense)
    saved = layer.state_dict()
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[n], state[n]) for n in state)
    assert torch.equal(fuse([layer, odd]).dense_weight(), torch.cat([dense, odd.dense_weight()]))
    with _plain_path():  # the PyTorch path works from the panels too
        reference = layer(round_activations(x, 32767) if fmt == "int8" else x)
    assert torch.allclose(reference.float(), y, rtol=1e-2 if fmt == "bfloat16" else 1e-4, atol=1e-3)
    layer.load_state_dict(state)  # loading the canonical layout works in either layout
    assert layer.panels is None and torch.equal(layer.weight, weight)
    assert torch.equal(layer(x), y)


@needs_kernels
def test_a_bound_product_is_its_kernel_and_rejects_unknown_names():
    k = kernels.cpu_kernels()
    gen = torch.Generator().manual_seed(11)
    weight, bias, x, residual = (torch.randn(32, 64, generator=gen), torch.randn(32, generator=gen),
                                 torch.randn(3, 64, generator=gen), torch.randn(3, 32, generator=gen))
    product = k.Product("linear_float", [weight], bias)
    assert torch.equal(product(x, residual), k.linear_float(x, weight, bias, residual))
    assert torch.equal(product(x), k.linear_float(x, weight, bias, None))
    with pytest.raises(RuntimeError, match="no product kernel named linear_nothing"):
        k.Product("linear_nothing", [weight], None)
    with pytest.raises(RuntimeError, match="takes 2 weight tensors"):
        k.Product("linear_int8", [weight], None)


def test_quantised_weights_are_smaller_and_close(folder):
    sizes = {fmt: _load(folder, fmt).weight_bytes() for fmt in ("float32", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["float32"] / 3
    weight = torch.randn(48, 64)
    layer = Int4Linear.from_float(weight)
    step = (weight.reshape(48, 2, 32).amax(-1) - weight.reshape(48, 2, 32).amin(-1)) / 15
    error = (layer.dense_weight() - weight).abs().reshape(48, 2, 32).amax(-1)
    assert bool((error <= step * 0.5 + 1e-3).all())


@needs_kernels
def test_tied_output_layer_shares_the_embedding_and_counts_once(tmp_path):
    tiny.save_hf_model(tmp_path, "qwen2", seed=4, tie_word_embeddings=True)
    model = load_model(tmp_path).model
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == embedding.data_ptr()  # no copy for float formats
    distinct = {t.data_ptr(): t.numel() * t.element_size()
                for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "rope" not in n]}
    assert weight_bytes(model) == sum(distinct.values())


class _FakeGGUFTensor:
    def __init__(self, kind: str, rows: int, cols: int, data: np.ndarray):
        from gguf import GGMLQuantizationType
        self.tensor_type = GGMLQuantizationType[kind]
        self.shape = np.array([cols, rows])
        self.data = data


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block_bytes, per_block = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, block_bytes), dtype=np.uint8)
    halves = 1 if kind == "Q4_0" else 2  # d (and m / dmin) are float16 numbers at the start
    values = rng.uniform(0.001, 0.05, size=(rows, cols // per_block, halves)).astype(np.float16)
    blocks[..., :2 * halves] = values.view(np.uint8).reshape(rows, cols // per_block, 2 * halves)
    return blocks.reshape(rows, -1)


def _random_gguf_tensor(kind: str, rows: int, cols: int, seed: int) -> tuple[_FakeGGUFTensor, torch.Tensor]:
    """A GGUF tensor of random blocks, and the table gguf's own decoder makes of it."""
    from gguf import quants

    tensor = _FakeGGUFTensor(kind, rows, cols, _random_blocks(kind, rows, cols, np.random.default_rng(seed)))
    return tensor, torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type)).reshape(rows, cols)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_repack_without_float32(kind):
    tensor, expected = _random_gguf_tensor(kind, 8, 512, seed=0)
    ours = int4_to_float(*int4_from_gguf(tensor))
    if kind == "Q4_K":  # scale and offset round to float16: within a thousandth of a step
        assert (ours - expected).abs().max() <= 1e-3 * expected.abs().max()
    else:
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_an_embedding_in_gguf_blocks_gives_the_rows_of_the_decoded_table(kind):
    from verispec.quant import embedding_from_gguf

    rows, cols = 40, 512
    tensor, table = _random_gguf_tensor(kind, rows, cols, seed=1)
    embedding = embedding_from_gguf(tensor, torch.float32)
    ids = torch.tensor([[3, 39, 0, 3], [7, 8, 21, 1]])
    assert torch.equal(embedding(ids), table[ids])
    assert embedding.blocks.numel() == tensor.data.size  # the blocks, nothing decoded
    assert embedding_from_gguf(_FakeGGUFTensor("F16", rows, cols, np.zeros((rows, cols), np.float16)),
                               torch.float32) is None  # a float table stays a table


def test_rows_decoded_once_are_kept_up_to_a_limit(monkeypatch):
    from verispec.quant import GgufEmbedding, embedding_from_gguf

    tensor, table = _random_gguf_tensor("Q4_K", 40, 512, seed=2)
    embedding = embedding_from_gguf(tensor, torch.float32)
    monkeypatch.setattr(GgufEmbedding, "CACHED_ROWS", 3)
    decoded = []
    real = embedding._decode
    monkeypatch.setattr(embedding, "_decode", lambda ids: decoded.append(list(ids)) or real(ids))
    for ids in ([[5, 9, 5]], [[9, 5]], [[7, 30, 5, 30]], [[30]], [[7, 1, 5]]):
        ids = torch.tensor(ids)
        assert torch.equal(embedding(ids), table[ids])
    assert decoded == [[5, 9], [7, 30], [30], [1]]  # 5, 9 and 7 kept; 30 and 1 beyond the limit
    assert sorted(embedding._rows) == [5, 7, 9]


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", "int4-mixed"])
def test_tokens_are_looked_up_in_the_files_embedding_blocks(tmp_path, monkeypatch, fmt):
    from verispec.loading import weight_cache
    from verispec.quant import GgufEmbedding

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=5)
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2", embedding_type="Q8_0")
    with _plain_path():  # without the kernels float32 is not packed: the decoded table itself
        whole_table = load_model(tmp_path / "model.gguf", weights="float32").model.model.embed_tokens
    assert isinstance(whole_table, torch.nn.Embedding)
    first = load_model(tmp_path / "model.gguf", weights=fmt)
    second = load_model(tmp_path / "model.gguf", weights=fmt)  # from the weight cache
    assert second.info.get("gguf_metadata_keys", 0) == 0
    ids = torch.arange(tiny.VOCAB).view(2, -1)
    for loaded in (first, second):
        embedding = loaded.model.model.embed_tokens
        assert isinstance(embedding, GgufEmbedding)
        assert embedding.blocks.numel() == tiny.VOCAB * 2 * 34  # 64 wide: two Q8_0 blocks of 34 bytes
        assert torch.equal(embedding(ids), whole_table(ids))
        assert loaded.weight_bytes() == sum(t.numel() * t.element_size() for n, t in loaded.model.state_dict().items()
                                            if "embed_tokens" not in n)  # a lookup, not a read
    assert (generate(first, PROMPT, max_tokens=12, ignore_eos=True).token_ids
            == generate(second, PROMPT, max_tokens=12, ignore_eos=True).token_ids)


def test_other_gguf_types_are_not_repacked():
    tensor = _FakeGGUFTensor("Q8_0", 2, 32, np.zeros((2, 34), dtype=np.uint8))
    assert int4_from_gguf(tensor) is None


@pytest.mark.parametrize("kind,mixed", [("Q4_K", Int4Linear), ("Q4_0", Int4Linear), ("Q6_K", Int8Linear),
                                        ("Q5_0", Int8Linear), ("Q8_0", Int8Linear), ("F16", Int8Linear),
                                        (None, Int4Linear)])
def test_int4_mixed_keeps_int8_where_the_file_holds_more_than_4_bits(kind, mixed):
    from verispec.quant import pack_linear

    linear = torch.nn.Linear(64, 32, bias=False)
    if kind == "Q4_K":
        data = _random_blocks("Q4_K", 32, 256, np.random.default_rng(0))
        linear = torch.nn.Linear(256, 32, bias=False)
    elif kind == "Q4_0":
        data = _random_blocks("Q4_0", 32, 64, np.random.default_rng(0))
    else:
        data = np.zeros((32, 1), dtype=np.uint8)  # not read: these types are not repacked
    tensor = None if kind is None else _FakeGGUFTensor(kind, 32, linear.in_features, data)
    assert type(pack_linear(linear, "int4-mixed", tensor)) is mixed
    assert type(pack_linear(linear, "int4", tensor)) is Int4Linear


def test_int4_mixed_loads_a_float_gguf_as_int8_and_decodes(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=6)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2")
    mixed = load_model(tmp_path / "model.gguf", weights="int4-mixed")
    plain = load_model(tmp_path / "model.gguf", weights="int4")
    int8 = load_model(tmp_path / "model.gguf", weights="int8")
    layers = [m for m in mixed.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(isinstance(m, Int8Linear) for m in layers)  # every tensor of the file is F32
    assert any(isinstance(m, Int4Linear) for m in plain.model.modules())
    assert mixed.weights == "int4-mixed" and mixed.weight_bytes() == int8.weight_bytes()
    assert generate(mixed, PROMPT, max_tokens=8, ignore_eos=True).token_ids == \
        generate(int8, PROMPT, max_tokens=8, ignore_eos=True).token_ids


def test_a_fused_product_with_an_int8_part_is_int8_throughout():
    parts = [Int4Linear.from_float(torch.randn(32, 64)), Int8Linear.from_float(torch.randn(16, 64))]
    fused = fuse(parts)
    assert isinstance(fused, Int8Linear) and fused.out_features == 48


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_weight_cache_round_trip(tmp_path, monkeypatch, fmt):
    from verispec.loading import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=5)
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2")
    first = load_model(tmp_path / "model.gguf", weights=fmt)
    assert list((tmp_path / "cache").glob("*.safetensors"))
    second = load_model(tmp_path / "model.gguf", weights=fmt)
    assert second.info.get("gguf_metadata_keys", 0) == 0  # came from the cache, not the file
    # no tensor points into the entry's memory map, so it is closed (its pages leave the resident set)
    assert str(tmp_path / "cache") not in Path("/proc/self/maps").read_text()
    a = generate(first, PROMPT, max_tokens=12, ignore_eos=True)
    b = generate(second, PROMPT, max_tokens=12, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert second.tokenizer.encode(PROMPT) == first.tokenizer.encode(PROMPT)
    # a model whose int4 layers have switched to the int4 kernel's panel layout stores the canonical one
    entry = tmp_path / "again" / "model-int4-0.safetensors"
    weight_cache.store(entry, first.model, first.config, first.tokenizer)
    model = weight_cache.load(entry)[0]
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in first.model.state_dict().items())


def test_weight_cache_drops_the_entries_of_files_that_are_gone(tmp_path, monkeypatch):
    """Each copy of a model file has its own entry; once a copy is deleted (a removed checkout
    or download), the next entry written removes its entry. Entries that do not name their
    file are kept."""
    import shutil

    from verispec.loading import weight_cache

    cache = tmp_path / "cache"
    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(cache))
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=6)
    copies = [tmp_path / name / "model.gguf" for name in ("a", "b", "c")]
    for path in copies:
        path.parent.mkdir()
    tiny.write_gguf(copies[0], ref, "qwen2")
    for path in copies[1:]:
        shutil.copy(copies[0], path)
    legacy = cache / "old-model-int8-0.safetensors"
    loaded = load_model(copies[0], weights="int8")
    weight_cache.store(legacy, loaded.model, loaded.config, loaded.tokenizer)  # names no file
    load_model(copies[1], weights="int8")
    entries = {weight_cache.entry_path(path, "int8", torch.float32) for path in copies[:2]}
    assert entries | {legacy} == set(cache.glob("*.safetensors"))
    shutil.rmtree(copies[0].parent)
    load_model(copies[2], weights="int8")
    kept = set(cache.glob("*.safetensors"))
    assert kept == {legacy, weight_cache.entry_path(copies[1], "int8", torch.float32),
                    weight_cache.entry_path(copies[2], "int8", torch.float32)}
    assert {p.with_suffix(".json") for p in kept} == set(cache.glob("*.json"))


@needs_kernels
def test_a_packed_model_keeps_no_weight_file_mapped(tmp_path):
    ref = tiny.save_hf_model(tmp_path, "qwen2", seed=2)
    loaded = load_model(tmp_path)  # float32, packed for the kernels
    # its tensors were views of the memory-mapped safetensors file: copied out, the map closed
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()
    with torch.no_grad():
        assert torch.equal(loaded.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)

@needs_kernels
def test_tied_float_output_layer_holds_the_only_copy_of_the_table(tmp_path, monkeypatch):
    from verispec.loading import weight_cache
    from verispec.quant import TiedEmbedding

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=4, tie_word_embeddings=True, vocab_size=272)  # 17 panels
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2")
    first = load_model(tmp_path / "model.gguf", weights="float32")
    model = first.model
    table = model.model.embed_tokens.weight.clone()
    a = generate(first, PROMPT, max_tokens=12, ignore_eos=True)
    assert model.lm_head.panels is not None and model.lm_head.weight is None  # the head runs its panels
    ids = torch.tensor([[0, 5, 17, table.shape[0] - 1], [3, 3, 16, 31]])
    assert torch.equal(model.model.embed_tokens(ids), table[ids])  # rows read from the panels
    assert torch.equal(model.model.embed_tokens.weight, table)
    held = {t.data_ptr(): t.numel() * t.element_size()
            for n, t in list(model.named_parameters()) + list(model.named_buffers()) if "rope" not in n}
    assert sum(held.values()) == weight_bytes(model)  # no second copy of the table
    second = load_model(tmp_path / "model.gguf", weights="float32")  # from the cache
    assert second.info.get("gguf_metadata_keys", 0) == 0
    assert isinstance(second.model.model.embed_tokens, TiedEmbedding)
    assert generate(second, PROMPT, max_tokens=12, ignore_eos=True).token_ids == a.token_ids
    with kernels.switched_off():  # the plain PyTorch path over the same table gives the same tokens
        plain = load_model(tmp_path / "hf", weights="float32")
        assert generate(plain, PROMPT, max_tokens=12, ignore_eos=True).token_ids == a.token_ids

def test_gpu_benchmark_runs_on_the_cpu_at_toy_sizes(tmp_path):
    out = tmp_path / "gpu.json"
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--tiny", "--device", "cpu",
         "--max-m", "5", "--tokens", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert completed.returncode == 0, completed.stdout + completed.stderr
    import json
    results = json.loads(out.read_text())
    check = results["engine_check"]
    assert check["ok"] and not check["failures"] and check["cli"]["returncode"] == 0
    assert set(check["formats"]) == {"float32", "bfloat16", "float16", "int8", "int4"}
    assert all(f["draft_equal"] and f["lookup_equal"] and f["moe_lookup_equal"] and f["gguf_equal"]
               for f in check["formats"].values())
    assert check["sampled"]["plain_repeats"] and check["sampled"]["draft_repeats"]
    assert set(results["models"]) == {"dense-8b", "moe-30b-a3b"}
    for model in results["models"].values():
        assert model["r"]["1"] == 1.0 and len(model["r"]) == 5
        assert len(model["grid"]) == 9 and all(cell["valid"] for cell in model["grid"].values())
        assert model["step_bytes"] > 0
        assert model["graph_error"] == "RuntimeError: CUDA graphs need a CUDA device"
        # the cost model's prediction from the measured r(γ+1), where m = γ+1 was measured
        cell = model["grid"]["a=0.5,g=4"]
        expected_tokens = (1 - 0.5 ** 5) / (1 - 0.5)
        assert abs(cell["predicted"] - expected_tokens / model["r"]["5"]) < 1e-9
        assert model["grid"]["a=0.5,g=8"]["predicted"] is None  # r(9) was not measured


def test_adaptive_draft_reads_only_the_recent_context_of_a_long_prompt(folder, tmp_path):
    from verispec.generate import READY_LAG
    from verispec.spec.draft_model import DraftModelProposer

    target = load_model(folder)
    tiny.save_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=1)
    draft = load_model(tmp_path)
    prompt = "the cat sat on the mat. " * 4  # longer than READY_LAG tokens
    prompt_tokens = len(target.tokenizer.encode(prompt))
    assert prompt_tokens > READY_LAG
    baseline = generate(target, prompt, max_tokens=40, ignore_eos=True)
    proposer = DraftModelProposer(draft, vocab_limit=target.config.vocab_size)
    result = generate(target, prompt, draft=proposer, gamma=4, adaptive="cost", max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert result.spec.gammas[1] == 0 and result.spec.gammas[2] > 0  # one plain step to time, then a draft
    assert proposer.offset == prompt_tokens + 2 - READY_LAG  # it skipped all but the last READY_LAG tokens
    # without --adaptive the draft reads the whole prompt up front
    fixed = DraftModelProposer(draft, vocab_limit=target.config.vocab_size)
    assert generate(target, prompt, draft=fixed, gamma=4, max_tokens=40, ignore_eos=True).token_ids == baseline.token_ids
    assert fixed.offset == 0


def test_two_copies_of_a_model_file_keep_a_cache_entry_each(tmp_path, monkeypatch):
    from verispec.loading import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=5)
    for copy in ("a", "b"):
        (tmp_path / copy).mkdir()
        tiny.write_gguf(tmp_path / copy / "model.gguf", ref, "qwen2")
        load_model(tmp_path / copy / "model.gguf", weights="int8")
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2
    again = load_model(tmp_path / "a" / "model.gguf", weights="int8")
    assert again.info.get("gguf_metadata_keys", 0) == 0  # still cached: the second copy did not evict it


def test_stack_ab_compares_the_kernels_with_a_patch_applied(tmp_path, monkeypatch):
    """benchmarks/stack_ab.py builds each trial as the current kernel source with a patch
    applied; a patch that no longer applies is refused with its name, not compared."""
    import difflib
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    stack_ab = importlib.import_module("stack_ab")
    lines = kernels._SOURCE.read_text().splitlines(True)
    changed = [lines[0].rstrip("\n") + " (patched)\n"] + lines[1:]
    diff = "".join(difflib.unified_diff(lines, changed, "a/src/verispec/kernels/cpu_kernels.cpp",
                                        "b/src/verispec/kernels/cpu_kernels.cpp"))
    (tmp_path / "comment.patch").write_text(diff)
    source = stack_ab.patched(tmp_path / "comment.patch", tmp_path / "one")
    assert source.name == "comment.cpp"
    assert source.read_text().splitlines(True) == changed

    (tmp_path / "stale.patch").write_text(diff.replace(lines[0].rstrip("\n"), "// another first line"))
    with pytest.raises(SystemExit, match="stale.patch does not apply"):
        stack_ab.patched(tmp_path / "stale.patch", tmp_path / "two")


def test_pair_prefetch_varies_the_distance_a_pass_of_that_size_uses(monkeypatch):
    """benchmarks/pair_prefetch.py --positions M varies the distance the kernels use for M
    positions: one-row products' pairs, passes' pairs (from pass_pair_rows rows), the one
    stream of passes with more rows than the format reads as pairs, or one-row products' one
    stream where they read one."""
    import importlib
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    pair_prefetch = importlib.import_module("pair_prefetch")
    zen4 = SimpleNamespace(panel_streams=lambda: 2, pair_rows={"integer": 8, "float": 3}.get,
                           pass_pair_rows=lambda weights: 3 if weights == "bfloat16" else 5)
    knobs = {(fmt, m): pair_prefetch.knob_at(zen4, fmt, m)
             for fmt in ("int4", "bfloat16", "float32") for m in (1, 2, 3, 5, 9)}
    assert knobs == {("int4", 1): "pair", ("int4", 2): "pair", ("int4", 3): "pair", ("int4", 5): "pass-pair",
                     ("int4", 9): "pass-stream", ("bfloat16", 1): "pair", ("bfloat16", 2): "pair",
                     ("bfloat16", 3): "pass-pair", ("bfloat16", 5): "pass-stream", ("bfloat16", 9): "pass-stream",
                     ("float32", 1): "pair", ("float32", 2): "pair", ("float32", 3): "pair",
                     ("float32", 5): "pass-stream", ("float32", 9): "pass-stream"}
    one_stream = SimpleNamespace(panel_streams=lambda: 1, pair_rows=zen4.pair_rows, pass_pair_rows=zen4.pass_pair_rows)
    assert [pair_prefetch.knob_at(one_stream, "int4", m) for m in (1, 2)] == ["stream", "pass-stream"]
    k = kernels.cpu_kernels()
    if k is not None:  # each knob is read and set through the kernels' own functions
        for knob in pair_prefetch.KNOBS:
            default = pair_prefetch.get_distance(k, knob)
            try:
                pair_prefetch.set_distance(k, knob, 4096)
                assert pair_prefetch.get_distance(k, knob) == 4096
            finally:
                pair_prefetch.set_distance(k, knob, default)


def test_every_saved_trial_still_applies_to_the_kernels(tmp_path, monkeypatch):
    """NOTES.md cites the trials in benchmarks/variants/ as rerunnable with stack_ab.py: each
    must apply to the current kernel source (refresh a patch when the source moves under it)."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    stack_ab = importlib.import_module("stack_ab")
    patches = sorted((REPO / "benchmarks" / "variants").glob("*.patch"))
    assert patches
    for patch in patches:
        source = stack_ab.patched(patch, tmp_path)
        assert source.read_text() != kernels._SOURCE.read_text(), patch.name


def test_rounds_are_split_by_spell_and_a_run_at_one_level_is_not_called_fast(monkeypatch):
    """The benchmarks compare ways within the host's fast and slow spells (read bandwidth
    within 80% of the best steady round, or below). A run that never left one level has a
    single group, whichever level that was; unsteady rounds are left out."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    stream_layout = importlib.import_module("stream_layout")

    def rounds(*levels):
        return [{"bandwidth_before": level, "bandwidth_after": level, "utilisation": {"current": 0.9}}
                for level in levels]

    unsteady = [{"bandwidth_before": 80e9, "bandwidth_after": 40e9, "utilisation": {"current": 0.5}}]
    groups = stream_layout.spell_groups(rounds(80e9, 78e9, 45e9) + unsteady)
    assert {name: len(group) for name, group in groups.items()} == {"fast": 2, "slow": 1}
    assert list(stream_layout.spell_groups(rounds(47e9, 50e9) + unsteady)) == ["single"]
    assert stream_layout.spells(rounds(47e9, 50e9))["single"]["bandwidth"] == [47e9, 50e9]


@needs_kernels
def test_reading_in_pieces_reads_the_same_bytes_in_place_and_continuous():
    """`stream_pieces`, the yardstick of benchmarks/stream_starts.py, reads the same whole sum
    steps (two vectors: 32 floats with AVX-512, 16 with AVX2) in both placements: each piece's
    streams where the piece lies, or each stream following its part of the piece before. Only
    what does not fill a step for every stream of every piece is left out."""
    k = kernels.cpu_kernels()
    step = 2 * k.lanes
    gen = torch.Generator().manual_seed(21)
    t = torch.randn(1_000_003, generator=gen)
    streams = 2 * min(torch.get_num_threads(), os.cpu_count() or 1)
    for pieces in (1, 3, 10):
        part = t.numel() // step // pieces // streams
        exact = float(t[:pieces * streams * part * step].double().sum())
        for continuous in (False, True):
            assert k.stream_pieces(t, pieces, continuous) == pytest.approx(exact, abs=1e-2)
    ones = torch.ones(64 * 8 * 32)  # nothing left out: a marker in the last step of all
    ones[-1] = 1000.0
    assert k.stream_pieces(ones, 8, True) == k.stream_pieces(ones, 8, False) == ones.numel() + 999.0
    with pytest.raises(RuntimeError, match="too many pieces"):
        k.stream_pieces(torch.ones(64), 3)


def test_adaptive_split_accounts_for_every_pass_and_its_trials_keep_the_output(folder, monkeypatch):
    """benchmarks/adaptive_split.py times --adaptive's target passes, draft steps and catch-up
    reading apart, and tries ways the engine does not carry: each must give the plain output,
    and the parts must fit within the decoding time they split."""
    import importlib

    from verispec.generate import READY_LAG
    from verispec.sampling import SamplingParams
    from verispec.spec.draft_model import DraftModelProposer
    from verispec.spec.prompt_lookup import PromptLookupProposer
    from verispec.spec.verifier import verify_greedy

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")
    target = load_model(folder)
    prompt = "the cat sat on the mat. " * 4  # longer than READY_LAG tokens
    monkeypatch.setattr(adaptive_split, "CONFIDENT", 0.0)  # a random model is sure of nothing
    records = adaptive_split.requests(target, target, prompt, 30, 4, adaptive_split.VARIANTS)
    assert set(records) == {"current", "draft-only", "draft-first", "late-probe", "plain-bound", "first-look",
                            "light-prior", "short-window", "first-draft-apart", "confident-probe",
                            "quick-reprobe", "heavy-prior", "fast-fall", "early-cap", "probe-budget", "plain-budget",
                            "ngram-apart", "ngram-3", "ngram-4", "ngram-8",
                            "ngram-3-only", "lookup-by-match"}
    assert records["draft-only"]["lookup_drafted"] == 0
    for name, r in records.items():
        assert r["valid"], name
        assert r["spec_rounds"] >= 1, name  # the first probe, at least
        assert r["plain_rounds"] + r["spec_rounds"] <= r["tokens"] - 1 <= r["plain_rounds"] + r["spec_tokens"], name
        assert r["other_s"] >= 0 and r["catch_ups"] >= 1, name
    assert records["current"]["catch_up_read"] == READY_LAG
    assert records["short-window"]["catch_up_read"] == adaptive_split.SHORT_WINDOW
    assert records["first-draft-apart"]["catch_up_read"] == READY_LAG - 1  # the last token read by a draft step
    import verispec.generate
    assert verispec.generate.READY_LAG == READY_LAG  # the trial's window does not outlive it
    assert verispec.generate.verify_greedy is verify_greedy  # nor the confidence's recording
    assert verispec.generate.PromptLookupProposer is PromptLookupProposer  # nor ngram-apart's lookup
    trials = {"ngram-3": (3, 2, False), "ngram-4": (4, 2, False), "ngram-8": (8, 2, False),
              "ngram-3-only": (3, 3, False), "lookup-by-match": (*verispec.generate.LOOKUP_NGRAM, True)}
    for name, settings in trials.items():
        with adaptive_split.policy(name):
            lookup = verispec.generate.policy_lookup()
        assert (lookup.max_ngram, lookup.min_ngram, lookup.bounded_by_match) == settings, name

    # plain steps within NEAR steps after a speculative round are `near`, the rest `far`
    passes = [(1, 1.0), (3, 9.0), (1, 2.0), (1, 2.0), (1, 2.0), (1, 4.0), (5, 9.0), (1, 6.0)]
    gammas = [0, 2, 0, 0, 0, 0, 4, 0]
    assert adaptive_split.NEAR == 3
    assert adaptive_split.steps_near_and_far(passes, gammas) == (3.0, 2.5)
    rows = [{"near_ms": 3.0, "far_ms": 2.5}, {"near_ms": float("nan"), "far_ms": 2.0},
            {"near_ms": 1.0, "far_ms": 4.0}, {"near_ms": 7.0, "far_ms": 5.0}]
    assert adaptive_split.near_minus_far(rows) == (
        "a plain step near a speculative round minus one far from it: median +0.5 ms (-3.0 to +2.0) over 3 requests")
    assert adaptive_split.near_minus_far(rows[1:2]).startswith("no request")

    # first-look reads FIRST_LOOK positions, and once a draft is kept the last READY_LAG afresh
    proposer = adaptive_split.FirstLookProposer(DraftModelProposer(target))
    context = target.tokenizer.encode(prompt)
    proposer.start(context, len(context) + 8, prefill=False)
    proposer.catch_up(context, READY_LAG)
    assert proposer.catch_ups[-1][1] == adaptive_split.FIRST_LOOK and proposer.lag(context) == 0
    drafts = proposer.propose(context, 2, SamplingParams(), None).tokens
    proposer.commit(len(context) + 1)  # the target kept the first draft and chose the next token
    context = context + [drafts[0], drafts[0]]
    assert proposer.lag(context) > 2  # generate() catches up before the next round
    proposer.catch_up(context, READY_LAG)
    assert proposer.catch_ups[-1][1] == READY_LAG and proposer.inner.offset == len(context) - READY_LAG


def test_policy_replay_keeps_the_engines_decisions_and_charges_the_cost_table(folder, monkeypatch):
    """benchmarks/policy_replay.py: the target's passes replaced by its greedy answer give that
    answer back, plainly or speculatively; plain decoding costs t(1) a step on the virtual
    clock; a model drafting for itself has every one of its drafts kept and beats plain decoding when
    passes over more positions cost little more; the target's replayed logits give each token the
    probability the real target gave it, which the `confident-probe` trial reads; the jitter is the
    seed's and only the seed's."""
    import importlib

    import verispec.generate

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    policy_replay = importlib.import_module("policy_replay")
    target, draft = load_model(folder), load_model(folder)
    prompt = "the cat sat on the mat."
    tokens, confidences = policy_replay.answer_of(target, prompt, 24)
    assert len(confidences) == len(tokens) and all(0 < p <= 1 for p in confidences)
    answer = (tokens, [0.99] * len(tokens))  # sure of every token: the confident-probe trial probes at once
    monkeypatch.setattr(verispec.generate, "READY_LAG", 4096)  # the draft reads all the context, as the target
    costs = {"target": {m: 1.0 + 0.1 * (m - 1) for m in range(1, 18)},
             "draft": {m: 0.05 + 0.01 * m for m in range(1, 34)}}
    plain = policy_replay.replay(target, draft, prompt, answer, "plain", costs, 24, 4)
    assert plain["valid"] and plain["plain_steps"] == len(tokens) - 1
    assert plain["decode_s"] == pytest.approx(len(tokens) - 1)
    for variant in policy_replay.VARIANTS:
        r = policy_replay.replay(target, draft, prompt, answer, variant, costs, 24, 4)
        assert r["valid"], variant
        assert r["spec_rounds"] >= 1, variant
        if variant in ("first-look", "short-window"):
            continue  # these read less than all the context: the draft's drafts are not the target's
        own_kept, own_drafted = r["accepted"] - r["lookup_accepted"], r["drafted"] - r["lookup_drafted"]
        assert own_kept == own_drafted > 0, variant  # prompt lookup's may fail
        assert r["decode_s"] < plain["decode_s"], variant
    assert verispec.generate.time is policy_replay.time  # the real clock is back
    limited = policy_replay.replay(target, draft, prompt, answer, "current", costs, 24, 4, draft_vocab=100)
    assert limited["valid"] and limited["spec_rounds"] >= 1
    assert set(policy_replay.measure(draft.model, range(1, 3), True, repeats=1, outputs=100)) == {1, 2}
    unsure = (tokens, [0.3] * len(tokens))
    assert policy_replay.replay(target, draft, prompt, unsure, "current", costs, 24, 4)["spec_rounds"] >= 1
    hesitant = policy_replay.replay(target, draft, prompt, unsure, "confident-probe", costs, 24, 4)
    assert hesitant["valid"] and hesitant["spec_rounds"] == 0
    with pytest.raises(ValueError, match="apart"):
        policy_replay.replay(target, target, prompt, answer, "plain", costs, 24, 4)
    assert policy_replay.cost_of({1: 1.0, 2: 1.5})(4) == 2.5

    def jittered(seed):
        clock = policy_replay.VirtualClock(0.15, seed)
        for _ in range(5):
            clock.spend(1.0)
        return clock.perf_counter()

    assert jittered(1) == jittered(1) != jittered(2) and jittered(1) != 5.0
    measured = policy_replay.measure(target.model, range(1, 3), last_only=False, repeats=1)
    assert set(measured) == {1, 2} and min(measured.values()) > 0


def test_policy_replay_reuses_an_earlier_records_answers_only_for_the_same_settings(tmp_path, monkeypatch):
    import importlib
    import json

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    policy_replay = importlib.import_module("policy_replay")
    run = {"target": "t", "weights": "int8"}
    saved = tmp_path / "replay.json"
    answers = {"qa/0": {"tokens": [5, 6], "confidences": [0.9, 0.4]}}
    saved.write_text(json.dumps({**run, "tokens": 64, "answers": answers}))
    assert policy_replay.known_answers(saved, run, 64) == {"qa/0": ([5, 6], [0.9, 0.4])}
    for other, tokens in (({**run, "weights": "int4"}, 64), (run, 128)):
        with pytest.raises(SystemExit, match="no answers for this run"):
            policy_replay.known_answers(saved, other, tokens)


def test_lookup_drafts_replays_prompt_lookup_round_by_round_and_charges_each_pass(monkeypatch):
    """benchmarks/lookup_drafts.py: a round's kept drafts are those the recorded answer has, and
    it costs a pass over the drafts and one more position; bounded by its match, a one-token
    match drafts one token."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    lookup_drafts = importlib.import_module("lookup_drafts")
    cost = {m: float(m) for m in range(1, 18)}  # t(m) = m
    prompt, answer = [1, 2, 3, 4, 5, 6], [9, 1, 7, 8, 7, 8]
    # after 9: no match (1); after 1: [2, 3, 4] (whole: room 3) or [2] (bounded), none kept; then no match,
    # no match, and no room (1 + 1 + 1)
    assert lookup_drafts.replay(prompt, answer, 4, cost, (3, 1), bounded=False) == 1 + 4 + 3
    assert lookup_drafts.replay(prompt, answer, 4, cost, (3, 1), bounded=True) == 1 + 2 + 3
    copy = [5, 6, 7, 8, 9, 10, 11, 12]
    # whole: [6, 7, 8, 9] all kept (5), then [11] kept (2); bounded: [6] (2), then [8, 9, 10] for a 3-token match (4),
    # then no room (1)
    assert lookup_drafts.replay(copy, copy, 4, cost, (3, 1), bounded=False) == 5 + 2
    assert lookup_drafts.replay(copy, copy, 4, cost, (3, 1), bounded=True) == 2 + 4 + 1


def test_speedup_repeats_each_adaptive_run_between_two_plain_runs(folder, monkeypatch):
    """benchmarks/speedup.py --adaptive-repeats N: plain, then N times --adaptive and plain,
    every --adaptive run timed against the plain runs on either side of it."""
    import importlib
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    speedup = importlib.import_module("speedup")
    target = load_model(folder)
    runs, real_run = [], speedup.run

    def counted_run(model, prompt, tokens, **options):
        runs.append("adaptive" if options.get("adaptive") else "plain")
        return real_run(model, prompt, tokens, **options)

    monkeypatch.setattr(speedup, "run", counted_run)
    prompts = [SimpleNamespace(text="the cat sat on the mat.", category="tiny")]
    ratios = speedup.adaptive_ratios(target, target, prompts, 12, 4, repeats=3)
    assert runs == ["plain", "adaptive", "plain", "adaptive", "plain", "adaptive", "plain"]
    assert set(ratios) == {"tiny"} and ratios["tiny"]["valid"]
    assert ratios["tiny"]["plain_s"] > 0 and ratios["tiny"]["ratio"] == ratios["tiny"]["plain_s"] / ratios["tiny"]["spec_s"]



def test_lab_comparisons_move_each_ways_place_from_prompt_to_prompt(monkeypatch):
    """perf_common.bracketed_runs: plain, each speculative way, plain again, the ways' order
    rotating with the prompt's index (a way run after another tends to time differently) while
    their results keep the ways' own order; the scripts that compare ways per prompt use it."""
    import importlib

    import verispec.generate as engine

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    perf_common = importlib.import_module("perf_common")
    order = []

    def recorded(model, text, draft=None, **options):
        order.append(draft or "plain")
        return (text, draft, options)

    monkeypatch.setattr(engine, "generate", recorded)
    drafts = {"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}
    runs = [perf_common.bracketed_runs("model", "text", drafts, index, 4, max_tokens=8) for index in range(3)]
    assert order == ["plain", "a", "b", "c", "plain", "plain", "b", "c", "a", "plain", "plain", "c", "a", "b", "plain"]
    for before, specs, after in runs:
        assert before == after == ("text", None, {"max_tokens": 8})
        assert list(specs) == ["a", "b", "c"]
        assert all(specs[name] == ("text", name, {"gamma": 4, "max_tokens": 8}) for name in drafts)


def test_adaptive_probe_runs_each_lag_in_the_prompts_turn_and_restores_the_engines(monkeypatch):
    """benchmarks/adaptive_probe.py: between two plain runs, one --adaptive run per lag, the
    engine's READY_LAG set to it for that run only, the lags' order moving with the prompt."""
    import importlib

    import verispec.generate as engine

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    adaptive_probe = importlib.import_module("adaptive_probe")
    default, order = engine.READY_LAG, []

    def recorded(model, text, draft=None, **options):
        order.append(engine.READY_LAG if draft else "plain")
        return engine.READY_LAG

    monkeypatch.setattr(engine, "generate", recorded)
    first = adaptive_probe.lag_runs("target", "draft", "text", [32, 16, 8], 0, 8, max_tokens=8)
    second = adaptive_probe.lag_runs("target", "draft", "text", [32, 16, 8], 1, 8, max_tokens=8)
    assert order == ["plain", 32, 16, 8, "plain", "plain", 16, 8, 32, "plain"]
    assert first == second == (default, {32: 32, 16: 16, 8: 8}, default)
    assert engine.READY_LAG == default


def test_adaptive_split_moves_each_variants_place_from_prompt_to_prompt(monkeypatch):
    """benchmarks/adaptive_split.py: the variants of one prompt run between its two plain runs,
    in the prompt's turn, and come back in the order asked for."""
    import importlib
    from types import SimpleNamespace

    import verispec.generate as engine

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")
    order, policy = [], adaptive_split.policy

    @contextlib.contextmanager
    def recorded_policy(name):
        order.append(name)
        with policy(name):
            yield

    monkeypatch.setattr(adaptive_split, "policy", recorded_policy)
    monkeypatch.setattr(adaptive_split, "timed_run", lambda *args, **options: (options.get("gamma"), []))
    monkeypatch.setattr(adaptive_split, "split", lambda plain, result, passes, proposer: result)
    monkeypatch.setattr(engine, "make_proposer", lambda draft, target: SimpleNamespace(name=draft))
    variants = ["current", "draft-only", "late-probe"]
    records = adaptive_split.requests("target", "draft", "text", 8, 4, variants, index=2)
    assert order == ["late-probe", "current", "draft-only"] and list(records) == variants

def test_adaptive_probe_times_the_drafts_part_both_ways_with_the_same_drafts(folder, monkeypatch):
    """benchmarks/adaptive_probe.py --draft-side: the first draft from the pass that reads the
    context, or from a pass of its own; the drafts must be the same."""
    import importlib
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    adaptive_probe = importlib.import_module("adaptive_probe")
    draft = load_model(folder)
    prompts = [SimpleNamespace(text="the cat sat on the mat. " * 3), SimpleNamespace(text="one two three four five")]
    r = adaptive_probe.draft_side(draft, prompts, rounds=2, lag=6)
    assert r["same_drafts"] and r["pairs"] == 4
    assert r["merged_ms"] > 0 and r["apart_ms"] > 0 and r["ratio"] > 0


def test_draft_context_measures_agreement_by_window_and_lookup_on_a_model_against_itself(folder, monkeypatch):
    """benchmarks/draft_context.py: a draft that is the target itself and reads the whole
    prompt agrees with every greedy token; lookup's shares are shares; the reading cost is
    a time per position."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    draft_context = importlib.import_module("draft_context")
    target = load_model(folder)
    prompt_ids = target.tokenizer.encode("the cat sat on the mat. " * 6)
    with torch.inference_mode():
        answer = draft_context.greedy_answer(target, prompt_ids, 20)
        assert 0 < len(answer) <= 20
        assert draft_context.agreement(target, prompt_ids, answer, len(prompt_ids), 0) == 1.0
        assert 0.0 <= draft_context.agreement(target, prompt_ids, answer, 4, 2) <= 1.0
        found, right = draft_context.lookup_agreement(prompt_ids, answer)
        assert 0.0 < found <= 1.0 and 0.0 <= right <= 1.0  # the repeated text gives lookup something
        assert draft_context.reading_ms(target, prompt_ids) > 0


def test_draft_vocab_compares_each_limit_with_and_without_the_contexts_ids(folder, monkeypatch):
    """benchmarks/draft_vocab.py: the whole vocabulary and each limit both ways, every run
    the plain output; a draft that is the target keeps all its drafts with the whole
    vocabulary, fewer with the first ids only, and more again with the context's."""
    import importlib

    from verispec.lab.prompts import Prompt

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    draft_vocab = importlib.import_module("draft_vocab")
    assert list(draft_vocab.ways_of([64])) == ["whole", "64 only", "64 and context"]
    assert list(draft_vocab.ways_of([64], alone=False)) == ["whole", "64 and context"]
    target = load_model(folder)
    plain = generate(target, "the cat sat on the mat.", max_tokens=24, ignore_eos=True)
    limit = sorted(plain.token_ids)[len(plain.token_ids) // 2] + 1
    prompts = [Prompt("cat", "test", "the cat sat on the mat."), Prompt("dog", "test", "a dog ran after the cat")]
    order, run = [], draft_vocab.run

    def recorded_run(*args, **options):
        draft = options.get("draft")
        order.append("plain" if draft is None else (draft.limited_to, draft.context_ids))
        return run(*args, **options)

    monkeypatch.setattr(draft_vocab, "run", recorded_run)
    totals = draft_vocab.compare(target, target, prompts, draft_vocab.ways_of([limit]), gamma=4, tokens=24)
    assert order[:5] == ["plain", (None, False), (limit, False), (limit, True), "plain"]
    assert order[5:] == ["plain", (limit, False), (limit, True), (None, False), "plain"]  # the next prompt's turn
    assert all(way["valid"] for way in totals.values())
    whole, only, context = (totals[w]["acceptance"] for w in ("whole", f"{limit} only", f"{limit} and context"))
    assert only < context <= whole == 1.0


def test_missed_draft_ids_counts_what_a_limited_draft_could_not_propose(monkeypatch):
    """benchmarks/missed_draft_ids.py: an answer's token above the limit is missed only where
    neither the prompt, the answer before it nor the standing marks hold it; over all prompts it
    counts distinct ids, those another prompt misses too, and what larger limits would hold."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    missed_draft_ids = importlib.import_module("missed_draft_ids")
    above, missed = missed_draft_ids.misses_of([1, 2, 100], [5, 100, 200, 200, 300, 60], 50, {300})
    assert (above, missed) == (5, [200, 60])
    found = {"a": [{"prompt_ids": [1], "answer_ids": [200, 70]}, {"prompt_ids": [70], "answer_ids": [70, 200]}],
             "b": [{"prompt_ids": [1], "answer_ids": [3, 90, 90]}]}
    summary = missed_draft_ids.summarise(found, 50, set(), [80, 100], str)
    assert summary["categories"]["a"] == {"tokens": 4, "above": 4, "missed": 3, "most_missed": [["200", 2], ["70", 1]]}
    assert (summary["tokens"], summary["missed"], summary["distinct"], summary["recurring"]) == (7, 4, 3, 2)
    assert summary["recurring_ids"] == [["200", 2, 2]] and summary["within"] == {"80": 1, "100": 2}



def test_penalty_agreement_sorts_each_position_by_whose_choice_the_penalties_changed(folder, tmp_path, monkeypatch):
    """benchmarks/penalty_agreement.py: a pass over the prompt and the penalised answer,
    penalised row by row, chooses the answer's tokens; each position falls in one cell, by
    whether the penalties changed the target's choice and the draft's; the target as its own
    draft agrees everywhere."""
    import importlib

    from verispec.penalties import Penalties

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    penalty_agreement = importlib.import_module("penalty_agreement")
    tiny.save_hf_model(tmp_path, "qwen2", seed=5, num_hidden_layers=1)
    target, draft = load_model(folder), load_model(tmp_path)
    prompt_ids = target.tokenizer.encode("the cat sat on the mat. the cat")
    penalties = Penalties(presence=1.5, frequency=1.5, repetition=1.5)
    answer = generate(target, prompt_ids, max_tokens=24, ignore_eos=True, presence_penalty=1.5,
                      frequency_penalty=1.5, repetition_penalty=1.5).token_ids
    rows = {name: penalty_agreement.rows_of(model, prompt_ids, answer) for name, model in (("t", target), ("d", draft))}
    done = {name: penalty_agreement.penalised(r, penalties, prompt_ids, answer) for name, r in rows.items()}
    assert done["t"].argmax(-1).tolist() == answer and rows["t"].argmax(-1).tolist() != answer
    cells = penalty_agreement.CELLS
    itself = penalty_agreement.position_counts(rows["t"], rows["t"], done["t"], done["t"], answer)
    assert itself["not_the_answer"] == 0
    assert itself["draft only"]["positions"] == itself["target only"]["positions"] == 0
    assert sum(itself[c]["penalised_draft_agrees"] for c in cells) == len(answer)
    assert sum(itself[c]["either_draft_agrees"] for c in cells) == len(answer)
    assert itself["both"]["positions"] > 0 and itself["both"]["unpenalised_draft_agrees"] == 0
    other = penalty_agreement.position_counts(rows["t"], rows["d"], done["t"], done["d"], answer)
    assert sum(other[c]["positions"] for c in cells) == len(answer) and other["not_the_answer"] == 0
    assert sum(other[c]["penalised_draft_agrees"] for c in cells) < len(answer)
    # one row by hand: the penalties move the draft's choice (column 1 to 0) and not the target's (2)
    plain_row, moved_row = torch.tensor([[0.0, 1.0, 0.5]]), torch.tensor([[2.0, 1.0, 0.5]])
    target_row = torch.tensor([[0.0, 0.0, 3.0]])
    by_hand = penalty_agreement.position_counts(target_row, plain_row, target_row, moved_row, [2])
    assert by_hand["draft only"] == {"positions": 1, "penalised_draft_agrees": 0, "unpenalised_draft_agrees": 0,
                                     "either_draft_agrees": 0}
    # the unpenalised choice (1) is the target's: a tree of both of the draft's choices holds it
    target_row = torch.tensor([[0.0, 3.0, 0.5]])
    by_hand = penalty_agreement.position_counts(target_row, plain_row, target_row, moved_row, [1])
    assert by_hand["draft only"] == {"positions": 1, "penalised_draft_agrees": 0, "unpenalised_draft_agrees": 1,
                                     "either_draft_agrees": 1}


def test_penalty_agreement_limits_the_draft_to_its_first_ids_and_the_context_so_far(monkeypatch):
    """benchmarks/penalty_agreement.py --draft-vocab: a row keeps the first ids, the standing
    ones, the prompt's and the answer's before its position; no limit keeps every row whole."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    penalty_agreement = importlib.import_module("penalty_agreement")
    rows = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    kept = penalty_agreement.limited(rows, 3, [5], [6, 1], [7, 4, 1])
    allowed = [sorted(torch.isfinite(row).nonzero().flatten().tolist()) for row in kept]
    assert allowed == [[0, 1, 2, 5, 6], [0, 1, 2, 5, 6, 7], [0, 1, 2, 4, 5, 6, 7]]
    assert torch.equal(kept[torch.isfinite(kept)], rows[torch.isfinite(kept)])
    assert penalty_agreement.limited(rows, None, [5], [6], [7, 4, 1]) is rows


def test_structure_mask_times_every_way_at_every_answer_position_and_leaves_the_matcher_in_place(
        folder, monkeypatch):
    """benchmarks/structure_mask.py: each way is timed once per position of a JSON answer, and
    none of them moves the matcher (the answer's tokens are still taken one by one after)."""
    import importlib

    from verispec.structured import Structure, StructureState

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    structure_mask = importlib.import_module("structure_mask")
    target = load_model(folder)
    vocab = target.config.vocab_size
    answer = generate(target, target.tokenizer.encode("the cat"), max_tokens=12, json_schema=True).token_ids
    answer = [t for t in answer if t not in target.tokenizer.eos_ids]
    assert answer
    state = StructureState(Structure.json(True), target.tokenizer, vocab)
    times = structure_mask.answer_times(state, answer, vocab)
    assert list(times) == list(structure_mask.WAYS)
    assert all(len(values) == len(answer) and min(values) > 0 for values in times.values())
    fresh = StructureState(Structure.json(True), target.tokenizer, vocab)
    fresh.add(answer)  # the same tokens from the start: the timed matcher took them as this one does
    assert torch.equal(state.allowed(), fresh.allowed())
    row = torch.randn(1, vocab)  # the engine's fill and masked_fill_'s agree
    assert torch.equal(state.apply(row), row.masked_fill(~state.allowed(), float("-inf")))


def test_penalty_cost_times_each_kind_of_row_in_turn(monkeypatch):
    """benchmarks/penalty_cost.py: a round's three kinds of call penalise rows of their own
    widths (the pass γ + 1 rows over the vocabulary), and every way is timed each round, the
    first moving from round to round."""
    import importlib
    import random

    from verispec.penalties import Penalties, PenaltyState
    from verispec.spec.draft_model import ColumnMap

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    penalty_cost = importlib.import_module("penalty_cost")
    state = PenaltyState(Penalties(presence=0.5, repetition=1.1), [5, 40_000])
    state.add([7, 7, 50_000])
    column_map = ColumnMap(penalty_cost.DRAFT_IDS, [40_000], {40_000: penalty_cost.DRAFT_IDS})
    calls = penalty_cost.calls_of_a_round(state, column_map, 4, random.Random(0))
    shapes = [tuple(state.apply(**call).shape) for call in calls.values()]
    assert shapes == [(1, penalty_cost.VOCAB), (1, penalty_cost.DRAFT_IDS + 64), (5, penalty_cost.VOCAB)]
    for call in calls.values():  # the engine's rows, bit for bit those of the earlier way
        assert torch.equal(state.apply(**call), penalty_cost.apply_as_before(state, **call))
    order = []
    seconds = penalty_cost.timed({name: (lambda name=name: order.append(name)) for name in "abc"}, 2, 3)
    assert list(seconds) == list("abc") and all(value >= 0 for value in seconds.values())
    assert order == list("aabbcc" "bbccaa" "ccaabb")


def test_freed_memory_child_decodes_plainly_and_speculatively_alike(folder, monkeypatch):
    """benchmarks/freed_memory.py: a child's run decodes each prompt plainly and speculatively,
    the same tokens, and counts its page faults."""
    import argparse
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    freed_memory = importlib.import_module("freed_memory")
    args = argparse.Namespace(target=str(folder), draft=str(folder), weights=None, draft_weights=None, prompts=2,
                              tokens=12)
    run = freed_memory.child(freed_memory.SETTINGS[0], args)
    assert len(run["plain_tok_s"]) == len(run["spec_tok_s"]) == len(run["tokens"]) == 2
    assert all(plain == spec and len(plain) > 0 for plain, spec in run["tokens"])
    assert run["faults"] >= 0 and min(run["spec_tok_s"]) > 0


def test_draft_vocab_audits_sampled_runs_by_their_distribution(folder, monkeypatch):
    """benchmarks/draft_vocab.py --temperature: runs sample, and each way's tokens (the plain runs'
    too) are tested against the target's distribution instead of compared token for token."""
    import importlib

    from verispec.lab.prompts import Prompt

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    draft_vocab = importlib.import_module("draft_vocab")
    target = load_model(folder)
    prompts = [Prompt("cat", "test", "the cat sat on the mat."), Prompt("dog", "test", "a dog ran after the cat")]
    totals = draft_vocab.compare(target, target, prompts, draft_vocab.ways_of([64]), gamma=4, tokens=32,
                                 temperature=0.8, seed=3)
    for way in totals.values():
        assert way["valid"] and set(way["p_values"]) == set(way["plain_p_values"]) == {"KS", "towards the draft"}
        assert min(way["p_values"].values()) >= 5e-5 and min(way["plain_p_values"].values()) >= 5e-5
        assert way["spec_steps"] > 0 and way["speedup"] > 0 and "evidence" not in way
    assert totals["whole"]["acceptance"] == 1.0  # the target as its own draft: every draft kept


def test_sampled_audit_passes_lossless_sampling_and_refuses_a_verifier_that_keeps_every_draft(folder, tmp_path,
                                                                                             monkeypatch):
    """benchmarks/sampled_audit.py on tiny models: the draft is another random model, far from the target."""
    import importlib

    from verispec.lab.prompts import Prompt

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sampled_audit = importlib.import_module("sampled_audit")
    tiny.save_hf_model(tmp_path, "qwen2", seed=11)
    target, draft = load_model(folder), load_model(tmp_path)
    prompts = [Prompt("cat", "test", "the cat sat on the mat."), Prompt("dog", "test", "a dog ran after the cat")]
    lossless = sampled_audit.audit_prompts(target, lambda: draft, prompts, gamma=4, tokens=48, temperature=0.5)
    with sampled_audit.keeping_every_draft():
        broken = sampled_audit.audit_prompts(target, lambda: draft, prompts, gamma=4, tokens=48, temperature=0.5)
    assert not lossless["refused"] and set(lossless["p_together"]) == {"KS", "towards the draft"}
    assert broken["refused"] and broken["p_together"]["towards the draft"] < 5e-5
    assert broken["acceptance"] > 0.8 > lossless["acceptance"]  # a draft that ends the answer ends its round
    lossless_again = sampled_audit.audit_prompts(target, lambda: draft, prompts, gamma=4, tokens=48, temperature=0.5)
    assert lossless_again == lossless  # the block put the lossless verifier back; seeds make runs repeat


def test_sampled_decoding_compares_each_earlier_way_and_puts_the_engine_back(folder, tmp_path, monkeypatch):
    """benchmarks/sampled_decoding.py on tiny models: each earlier way and the engine's decode,
    follow the target's distribution and are timed per token; what a way replaces (the draw,
    the warp, the warp's kernels, the verifier, the draft's draw) is back in place afterwards."""
    import importlib

    import verispec.generate as engine
    import verispec.sampling as sampling
    import verispec.spec.draft_model as draft_model
    import verispec.spec.verifier as verifier
    from verispec.lab.audit import check_sampled_output
    from verispec.lab.prompts import Prompt

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sampled_decoding = importlib.import_module("sampled_decoding")
    tiny.save_hf_model(tmp_path, "qwen2", seed=11)
    target, draft = load_model(folder), load_model(tmp_path)
    prompts = [Prompt("cat", "test", "the cat sat on the mat."), Prompt("dog", "test", "a dog ran after the cat")]
    engine_parts = (sampling.sample, verifier.sample, sampling.probabilities, draft_model.probabilities,
                    engine.verify_sampling, draft_model.DraftModelProposer._draw)
    with sampled_decoding.drawing_with_multinomial():
        assert sampling.sample is verifier.sample is sampled_decoding.multinomial_draw
    with sampled_decoding.over_whole_rows():
        assert engine.verify_sampling is sampled_decoding.verify_over_whole_rows
    with sampled_decoding.warping_with_numpy():
        assert sampling.cpu_kernels() is None  # the warp's kernels only: the model's stay
        assert sampling.cpu_kernels is not kernels.cpu_kernels
    assert sampling.cpu_kernels is kernels.cpu_kernels
    ways = {**sampled_decoding.EARLIER_WAYS, "now": contextlib.nullcontext, "greedy": contextlib.nullcontext}
    order = []

    def recorded(name, context):
        return lambda: (order.append(name), context())[1]

    warp = {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    totals = sampled_decoding.compare(target, draft, prompts, {name: recorded(name, context)
                                                               for name, context in ways.items()},
                                      gamma=3, tokens=24, warp=warp)
    assert order == [*ways, *list(ways)[1:], *list(ways)[:1]]  # the second prompt's turn starts one way on
    assert (sampling.sample, verifier.sample, sampling.probabilities, draft_model.probabilities,
            engine.verify_sampling, draft_model.DraftModelProposer._draw) == engine_parts
    assert set(totals) == {"whole-rows", "torch.multinomial", "numpy-warp", "now", "greedy"}
    for way in totals.values():
        assert way["plain_steps"] > 0 and way["spec_steps"] > 0 and way["speedup"] > 0 and way["c"] > 0
    for name in ("whole-rows", "torch.multinomial", "numpy-warp", "now"):
        assert len(totals[name]["evidence"]) == 4 and check_sampled_output(totals[name]["evidence"]).valid
    assert totals["greedy"]["equal"] and "evidence" not in totals["greedy"]


def test_overhead_times_each_warp_every_way(monkeypatch):
    """benchmarks/overhead.py's warp timings run on a small vocabulary: each warp, every way
    (torch's, the CPU path's, and the CPU path's with the kernels off, which are left on after)."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    overhead = importlib.import_module("overhead")
    times = overhead.warp_times(vocab=4096, calls=2, rounds=1)
    assert set(times) == set(overhead.WARPS)
    assert all(set(way) == {"torch", "cpu", "numpy"} and min(way.values()) > 0 for way in times.values())
    assert kernels.enabled()
    logits = overhead.zipf_logits(4096, torch.Generator().manual_seed(0))
    assert sorted(logits.tolist(), reverse=True)[:2] == pytest.approx([0.0, -1.1 * math.log(2)], abs=1e-6)


def test_read_bandwidth_by_buffer_size_and_the_last_level_cache(monkeypatch, tmp_path):
    """perf_common reads the largest cache level from sysfs' layout; read_bandwidth.py's
    sizes and thread counts each get a figure every round."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    perf_common = importlib.import_module("perf_common")
    for name, level, size in (("index0", 1, "48K"), ("index2", 2, "2048K"), ("index3", 3, "266240K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    assert perf_common.last_level_cache(tmp_path) == 266240 << 10
    assert perf_common.last_level_cache(tmp_path / "none") == 0

    read_bandwidth = importlib.import_module("read_bandwidth")
    seen = read_bandwidth.by_size([1 / 512, 1 / 256], rounds=2, repeats=1)
    assert set(seen) == {1 / 512, 1 / 256}
    assert all(len(rates) == 2 and min(rates) > 0 for rates in seen.values())
    threads = torch.get_num_threads()
    by_count = read_bandwidth.by_threads([1, 2], 1 / 512, rounds=2, repeats=1)
    assert set(by_count) == {1, 2}
    assert all(len(rates) == 2 and min(rates) > 0 for rates in by_count.values())
    assert torch.get_num_threads() == threads  # the thread count is put back


@pytest.mark.parametrize("model", ["1.5b", "0.5b"])
def test_product_starts_builds_int4_products_that_the_kernels_multiply(monkeypatch, model):
    """product_starts.py --weights int4 (--model): each of a layer's products is a valid int4
    panel tensor (finite scales, the kernel's product equals the canonical weights' within the
    activations' rounding), and its loads-only view is the same bytes as int8 panels, read
    alone only where they make whole groups of 32 inputs (the 0.5B's 896 inputs do not)."""
    import importlib

    from verispec.quant import int4_from_panels, int4_to_float

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    product_starts = importlib.import_module("product_starts")
    layers, shapes = product_starts.MODELS[model]
    assert layers == {"1.5b": 28, "0.5b": 24}[model]
    flat, products, inputs, _ = product_starts.build(1, "int4", shapes)
    assert flat.numel() == sum(product_starts.panel_bytes("int4", n, k) for n, k in shapes.values())
    for name, (n, k) in shapes.items():
        panels = products[name][0]
        assert tuple(panels.shape) == (n // 16, k // 32, 320)
        view = product_starts.as_int8_panels(panels)
        assert view.dtype == torch.int8 and view.data_ptr() == panels.data_ptr() and view.numel() == panels.numel()
        whole_groups = view.shape[1] * 4 % 32 == 0
        # a panel's 10 B per input are 10 / 16 of an input of 16 int8 columns: whole groups where 10k / 16 is
        # a multiple of 32
        assert product_starts.reads_as_int8_panels(panels) == whole_groups == (k * 10 % 512 == 0)
    _, int8_products, _, _ = product_starts.build(1, "int8", shapes)
    assert all(product_starts.reads_as_int8_panels(p[0]) for p in int8_products.values())
    nibbles, scales = int4_from_panels(products["o"][0])
    reference = inputs["o"] @ int4_to_float(nibbles, scales).T
    assert torch.isfinite(reference).all()
    k = kernels.cpu_kernels()
    if k is not None and hasattr(k, "linear_int4_panels"):
        y = k.linear_int4_panels(inputs["o"], products["o"][0], None, None)
        assert (y - reference).abs().max() <= 0.02 * reference.abs().max()
        assert k.read_int8_panels(product_starts.as_int8_panels(products["down"][0])).shape == (1, shapes["down"][0])


FAKE_SCRIPTS = {  # what each stand-in prints (its arguments first), and how it ends
    "overhead.py": 'print("[    MET] 7 framework overhead: 0.1 ms per step (< 1 ms)")',
    "decode_bandwidth.py": 'print("[NOT MET] 1 bandwidth, int4: 80%")\nprint("[    MET] 3 verification cost: r(5) = 1.2")\n'
                           'sys.exit(1)',
    "agreement.py": 'print("[    MET] 2 agreement, target int8: 99%")\nraise RuntimeError("broken")',
    "speedup.py": 'print("speed-up 1.8x, no verdict")',
    "vs_llama_cpp.py": 'print("[    n/a] 6 against llama.cpp: llama-cpp-python is not installed")',
}


def fake_scripts(folder: Path) -> Path:
    for name, body in FAKE_SCRIPTS.items():
        (folder / name).write_text(f"import sys\nprint('args:', sys.argv[1:])\n{body}\n")
    return folder


def targets_without_cuda(monkeypatch):
    """benchmarks/targets.py, on a machine it is told has no CUDA device."""
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    targets = importlib.import_module("targets")
    monkeypatch.setattr(targets, "cuda_available", lambda: False)
    return targets


def test_the_targets_runner_gathers_every_verdict_and_fails_on_a_target_not_met_or_a_broken_script(tmp_path,
                                                                                                    monkeypatch):
    targets = targets_without_cuda(monkeypatch)
    scripts, results = fake_scripts(tmp_path), tmp_path / "results"
    assert targets.main(["--quick"], scripts=scripts, results=results) == 1
    log = next(results.glob("targets_quick_run_*.log")).read_text()
    ran, verdicts = log.split("\nevery verdict:\n")
    assert ran.count("args: ['--quick']") == len(FAKE_SCRIPTS)
    assert verdicts.splitlines() == [
        "[    MET] 7 framework overhead: 0.1 ms per step (< 1 ms)",
        "[NOT MET] 1 bandwidth, int4: 80%",  # its exit status 1 says so; not a failure of the script
        "[    MET] 3 verification cost: r(5) = 1.2",
        "[    MET] 2 agreement, target int8: 99%",
        "[ FAILED] agreement.py exited with status 1",
        "[ FAILED] speedup.py printed no verdict",
        "[    n/a] 6 against llama.cpp: llama-cpp-python is not installed",
        "[    n/a] 8 GPU: no CUDA device here (the tests run gpu_bench.py --tiny on the CPU)",
    ]


def test_the_targets_runner_runs_only_the_scripts_of_the_targets_asked_for(tmp_path, monkeypatch):
    targets = targets_without_cuda(monkeypatch)
    scripts, results = fake_scripts(tmp_path), tmp_path / "results"
    assert targets.main(["--only", "7", "6"], scripts=scripts, results=results) == 0
    log = next(results.glob("targets_run_*.log")).read_text()
    assert log.count("args: []") == 2 and "bandwidth" not in log and "GPU" not in log
    checks, skipped = targets.planned({8}, cuda=True)
    assert [c.script for c in checks] == ["gpu_bench.py"] and skipped == []
    gpu = targets.Outcome(checks[0], 0)  # figures, no verdict lines: a run, not a failure
    assert targets.summary([gpu], []) == (["[    n/a] 8: gpu_bench.py ran; its figures are above"], True)


def test_a_crashed_llama_cpp_worker_on_a_processor_with_amx_says_how_to_build_it_without(tmp_path, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    vs_llama_cpp = importlib.import_module("vs_llama_cpp")
    crashed = vs_llama_cpp.worker_died(-11, "plain", amx=True)
    assert crashed.startswith("llama.cpp's worker ended (exit status -11) on a plain request; this processor has AMX")
    assert crashed.endswith("rebuild it without them (pip uninstall -y llama-cpp-python; make bench)")
    assert "AMX" not in vs_llama_cpp.worker_died(-11, "plain", amx=False)
    assert "AMX" not in vs_llama_cpp.worker_died(1, "speculative", amx=True)  # it exited; it did not crash
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert vs_llama_cpp.has_amx(cpuinfo)
    cpuinfo.write_text("flags\t\t: fpu avx512f avx512_vnni\n")
    assert not vs_llama_cpp.has_amx(cpuinfo) and not vs_llama_cpp.has_amx(tmp_path / "missing")
