"""The engine against the transformers reference: dense families, HF folders and GGUF files, the cache."""

from __future__ import annotations

import pytest
import torch

import tiny
from verispec.loading import load_model

IDS = torch.tensor([[5, 77, 100, 3, 9, 200, 42, 17]])

FAMILIES = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
]


def _ids(params):
    family, overrides = params
    return family + ("-" + "-".join(f"{k}" for k in overrides) if overrides else "") + (
        "-" + overrides["rope_scaling"]["rope_type"] if "rope_scaling" in overrides else "")


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(ids).logits.float()


def stepwise_logits(model, ids, cache=None):
    cache = cache or model.new_cache(64)
    rows = [model(ids[:, i:i + 1], cache)[0, -1] for i in range(ids.shape[1])]
    return torch.stack(rows).unsqueeze(0)


@pytest.mark.parametrize("params", FAMILIES, ids=[_ids(p) for p in FAMILIES])
def test_hf_folder_matches_transformers(tmp_path, params):
    family, overrides = params
    ref = tiny.save_hf_model(tmp_path, family, **overrides)
    ours = load_model(tmp_path).model
    expected = reference_logits(ref, IDS)
    with torch.no_grad():
        prefill = ours(IDS, ours.new_cache(64))
        steps = stepwise_logits(ours, IDS)
    assert (prefill - expected).abs().max() <= 1e-4
    assert (steps - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("family,arch", [("qwen2", "qwen2"), ("llama", "llama"), ("qwen3", "qwen3")])
def test_gguf_matches_transformers(tmp_path, family, arch):
    ref = tiny.save_hf_model(tmp_path, family)
    tiny.write_gguf(tmp_path / "model.gguf", ref, arch)
    loaded = load_model(tmp_path / "model.gguf")
    assert loaded.config.model_type == family
    assert loaded.tokenizer.chat_template == tiny.CHAT_TEMPLATE
    assert loaded.tokenizer.eos_ids == {tiny.EOS_ID}
    expected = reference_logits(ref, IDS)
    with torch.no_grad():
        assert (loaded.model(IDS, loaded.model.new_cache(64)) - expected).abs().max() <= 1e-4
        assert (stepwise_logits(loaded.model, IDS) - expected).abs().max() <= 1e-4


def test_sharded_safetensors(tmp_path):
    ref = tiny.save_hf_model(tmp_path / "one", "qwen2")
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    tiny.write_tokenizer(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = load_model(tmp_path / "sharded")
    with torch.no_grad():
        got = loaded.model(IDS, loaded.model.new_cache(64))
    assert (got - reference_logits(ref, IDS)).abs().max() <= 1e-4


def test_tokenizer_and_chat_template_from_folder(tmp_path):
    tiny.save_hf_model(tmp_path, "qwen2")
    tok = load_model(tmp_path).tokenizer
    text = "hello world"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bfloat16_weights_decode(tmp_path):
    ref = tiny.save_hf_model(tmp_path, "qwen2")
    loaded = load_model(tmp_path, dtype="bfloat16")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        got = loaded.model(IDS, loaded.model.new_cache(64))
    assert got.dtype == torch.float32
    # bfloat16 keeps ~3 significant digits: close to the float32 reference, not equal
    assert (got - reference_logits(ref, IDS)).abs().max() < 0.5


class TestCache:
    @pytest.fixture
    def model(self, tmp_path):
        tiny.save_hf_model(tmp_path, "qwen2")
        return load_model(tmp_path).model

    def test_steps_equal_one_pass(self, model):
        with torch.no_grad():
            full = model(IDS, model.new_cache(64))
            assert (stepwise_logits(model, IDS) - full).abs().max() <= 1e-5

    def test_rollback_then_decode_equals_fresh_run(self, model):
        other = torch.tensor([[11, 12, 13, 14]])
        with torch.no_grad():
            cache = model.new_cache(64)
            model(IDS, cache)
            cache.rollback(3)
            assert cache.length == 3
            after = model(other, cache)
            fresh = model(torch.cat([IDS[:, :3], other], dim=1), model.new_cache(64))[:, 3:]
        assert (after - fresh).abs().max() <= 1e-5

    def test_rollback_past_length_is_refused(self, model):
        from verispec.errors import RollbackError
        cache = model.new_cache(16)
        with torch.no_grad():
            model(IDS[:, :4], cache)
        with pytest.raises(RollbackError):
            cache.rollback(5)

    def test_overflowing_the_cache_is_an_error(self, model):
        from verispec.errors import ContextOverflowError
        with pytest.raises(ContextOverflowError), torch.no_grad():
            model(IDS, model.new_cache(4))


def test_attention_leaves_out_cudnn_on_cuda_and_changes_nothing_on_the_cpu():
    """cuDNN's attention prepares a graph for every new key length, and decoding has a new one
    at every step; the other backends stay available."""
    from verispec.models.common import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
