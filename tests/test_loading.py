"""Loading layer by layer: each decoder layer is packed before the next one is read, and
nothing on the way changes a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny
from verispec import quant
from verispec.generate import generate
from verispec.loading import gguf_file, hf_folder, load_model

LAYERS = 3
PROMPT = "the cat sat on the mat. the cat"


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("VERISPEC_WEIGHT_CACHE", "0")


def _record_loading(monkeypatch, reader_module, reader_name: str) -> list[str]:
    """Events in order: "read N" when layer group N is asked for, "pack PREFIX" when a
    decoder layer is packed."""
    events: list[str] = []
    real_reader, real_pack = getattr(reader_module, reader_name), quant.pack_projections

    def reader(*args, **kwargs):
        result = real_reader(*args, **kwargs)

        def groups(layers):
            for index, group in enumerate(layers):
                events.append(f"read {index}")
                yield group

        if reader_name == "read_state":  # yields the groups itself
            return groups(result)
        config, layers, meta, quantized = result
        return config, groups(layers), meta, quantized

    def pack(root, fmt, gguf_tensors, prefix=""):
        events.append(f"pack {prefix}")
        return real_pack(root, fmt, gguf_tensors, prefix)

    monkeypatch.setattr(reader_module, reader_name, reader)
    monkeypatch.setattr(quant, "pack_projections", pack)
    return events


@pytest.mark.parametrize("source", ["gguf", "folder"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "bfloat16"])
def test_each_layer_is_packed_before_the_next_one_is_read(tmp_path, monkeypatch, source, fmt):
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=3, num_hidden_layers=LAYERS)
    path = tmp_path / "hf"
    if source == "gguf":
        path = tmp_path / "model.gguf"
        tiny.write_gguf(path, ref, "qwen2", embedding_type="Q8_0")
    reference = generate(load_model(path, weights=fmt), PROMPT, max_tokens=10, ignore_eos=True).token_ids
    events = _record_loading(monkeypatch, *((gguf_file, "read_gguf") if source == "gguf"
                                           else (hf_folder, "read_state")))
    loaded = load_model(path, weights=fmt)
    layer_events = [e for e in events if e.startswith("read") or e.startswith("pack model.layers.")]
    expected = []
    for layer in range(LAYERS):
        expected += [f"read {layer}", f"pack model.layers.{layer}."]
    assert layer_events[:2 * LAYERS] == expected
    assert events.count(f"read {LAYERS}") == 1  # then the rest: embedding, final norm, output layer
    assert all(isinstance(m, quant.PackedLinear) for layer in loaded.model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert generate(loaded, PROMPT, max_tokens=10, ignore_eos=True).token_ids == reference


def test_a_layer_without_all_its_weights_is_named_not_packed(tmp_path):
    from safetensors.torch import load_file, save_file

    from verispec.errors import CorruptModelError

    tiny.save_hf_model(tmp_path, "qwen2", seed=3, num_hidden_layers=LAYERS)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(CorruptModelError, match=r"1 weight\(s\) missing: model.layers.1.mlp.down_proj.weight"):
        load_model(tmp_path, weights="int8")


def test_an_embedding_served_from_its_blocks_is_never_decoded(tmp_path, monkeypatch):
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=3, num_hidden_layers=LAYERS)
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2", embedding_type="Q8_0")
    decoded: list[str] = []
    real = gguf_file.dequantize
    monkeypatch.setattr(gguf_file, "dequantize", lambda tensor: decoded.append(tensor.name) or real(tensor))
    loaded = load_model(tmp_path / "model.gguf", weights="int8")
    assert isinstance(loaded.model.model.embed_tokens, quant.GgufEmbedding)
    assert "token_embd.weight" not in decoded and "output.weight" in decoded
    ids = torch.arange(tiny.VOCAB).view(1, -1)
    assert torch.equal(loaded.model.model.embed_tokens(ids)[0], _q8_0_table(ref))


def _q8_0_table(ref) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    table = ref.model.embed_tokens.weight.detach().float().numpy()
    blocks = quants.quantize(table, GGMLQuantizationType.Q8_0)
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("convert", [quant.int8_from_float, quant.int4_from_float])
def test_quantising_in_row_chunks_changes_nothing(monkeypatch, convert):
    weight = torch.randn(1000, 96)
    whole = convert(weight)
    monkeypatch.setattr(quant, "ROWS_AT_ONCE", 64)  # 1000 rows: 15 chunks of 64 and one of 40
    chunked = convert(weight)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_1"])
def test_dequantising_in_row_chunks_changes_nothing(monkeypatch, kind):
    from gguf import GGMLQuantizationType, quants

    rows, cols = 300, 256
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)

    class Tensor:
        tensor_type = GGMLQuantizationType[kind]
        shape = np.array([cols, rows])
        data = quants.quantize(values, GGMLQuantizationType[kind])

    whole = gguf_file.dequantize(Tensor)
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_ROWS", 7)
    chunked = gguf_file.dequantize(Tensor)
    assert chunked.shape == (rows, cols)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, torch.from_numpy(quants.dequantize(Tensor.data, Tensor.tensor_type)))


def test_the_one_slow_load_of_a_file_says_so_on_the_command_line(tmp_path, monkeypatch, capsys):
    """Decoding and packing a GGUF file takes most of a minute for the 1.5B; that first load
    says what it does, and later loads, from the weight cache, say nothing."""
    from verispec.cli import main
    from verispec.loading import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_WEIGHT_CACHE", "1")  # this module's tests load without it otherwise
    ref = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=5)
    tiny.write_gguf(tmp_path / "model.gguf", ref, "qwen2")
    argv = ["generate", "--model", str(tmp_path / "model.gguf"), "--weights", "int8", "-n", "2", "--json", "hi"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "model.gguf: decoding and packing its weights as int8, once" in err and str(tmp_path / "cache") in err
    assert main(argv) == 0
    assert "packing" not in capsys.readouterr().err
