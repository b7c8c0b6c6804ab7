"""Tiny random models for the tests: Hugging Face folders and GGUF files built on the spot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = [("a", "b"), ("c", "d"), ("Ġ", "t")]


def byte_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    for token in SPECIALS:
        vocab[token] = len(vocab)
    return vocab


def tiny_tokenizer():
    """A byte-level BPE tokenizer: 256 bytes, three merges, three special tokens (262 ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(byte_vocab(), list(MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


VOCAB = 262
EOS_ID = byte_vocab()["<|im_end|>"]
# Qwen2.5-Coder's fill-in-the-middle marks and padding, which `write_tokenizer(infill=True)`
# adds after the three special tokens (ids 262-265)
INFILL_SPECIALS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"]


def write_tokenizer(folder: Path, infill: bool = False) -> None:
    """The tiny tokenizer and its settings; with `infill`, the fill-in-the-middle marks too
    (for a model of VOCAB + len(INFILL_SPECIALS) ids)."""
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    if infill:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in INFILL_SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE, "add_bos_token": False}))


def hf_config(family: str, **overrides):
    """A tiny transformers config of the given family."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=EOS_ID, bos_token_id=None, tie_word_embeddings=False)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    if family == "qwen3":
        common["head_dim"] = 16
    common.update(overrides)
    return cls(**common)


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.15) -> None:
    """Larger-than-default random weights, so logits have clear winners (few near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


def save_hf_model(folder: Path, family: str = "qwen2", seed: int = 0, **overrides):
    """Build, randomise and save a tiny transformers model; returns the transformers model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)
    return model


def pass_and_steps(model: torch.nn.Module, ids: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for ids[prefix:] from one pass and from single steps, each after the same prefix."""
    with torch.inference_mode():
        cache = model.new_cache(ids.shape[1] + 1)
        model(ids[:, :prefix], cache)
        one_pass = model(ids[:, prefix:], cache)
        cache = model.new_cache(ids.shape[1] + 1)
        model(ids[:, :prefix], cache)
        steps = torch.cat([model(ids[:, i:i + 1], cache) for i in range(prefix, ids.shape[1])], dim=1)
    return one_pass, steps


# ------------------------------------------------------------------ GGUF

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the 'llama' architecture."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_gguf_tokenizer(writer) -> None:
    """The tiny byte-level tokenizer and chat template, as GGUF metadata."""
    vocab = byte_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(path: Path, hf_model, arch: str, embedding_type: str | None = None) -> None:
    """Write a transformers dense model as an F32 GGUF file with the tiny tokenizer embedded
    (its token embedding in GGML type `embedding_type`, such as "Q8_0", if given)."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters")
                              else cfg.rope_theta)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    add_gguf_tokenizer(writer)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            module, kind = ".".join(parts[3:-1]), parts[-1]
            gguf_name = f"blk.{parts[2]}.{_GGUF_BLOCK[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = _permute(array, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = _permute(array, cfg.num_key_value_heads)
        if gguf_name == "token_embd.weight" and embedding_type:
            kind = gguf.GGMLQuantizationType[embedding_type]
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_as(folder: Path, fmt: str):
    """The model in `folder` in weight format `fmt` (bfloat16 activations for bfloat16 weights)."""
    from verispec.loading import load_model

    return load_model(folder, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt)


def tiny_lm(vocab: int, seed: int):
    """A one-layer Qwen2-shaped LoadedModel over `vocab` ids, small enough to enumerate its
    distribution over a few tokens (`exact_distribution`)."""
    from verispec.config import ModelConfig
    from verispec.loading import LoadedModel
    from verispec.loading.tokenizer import Tokenizer
    from verispec.models.dense import CausalLM

    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                         max_position_embeddings=64)
    torch.manual_seed(seed)
    model = CausalLM(config)
    randomize(model, seed, scale=0.25)
    model.eval()
    tokenizer = Tokenizer(tiny_tokenizer(), eos_ids=set())
    return LoadedModel("tiny", None, model, tokenizer, config, 0.0, torch.float32, torch.device("cpu"))


def exact_distribution(model, prompt: list[int], steps: int, params, penalties=None) -> dict[tuple, float]:
    """P(first `steps` tokens) under plain sampling, by enumeration; with `penalties`
    (verispec.penalties.Penalties) on the logits of each step, given the tokens before it."""
    from verispec.penalties import PenaltyState
    from verispec.sampling import probabilities

    dist = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for prefix, p in dist.items():
            with torch.no_grad():
                logits = model.model(torch.tensor([prompt + list(prefix)]), model.model.new_cache(16))[0, -1]
            if penalties is not None:
                state = PenaltyState(penalties, prompt)
                state.add(prefix)
                logits = state.apply(logits[None], [])[0]
            probs = probabilities(logits, params)
            for token, q in enumerate(probs.tolist()):
                if q > 0:
                    grown[prefix + (token,)] = p * q
        dist = grown
    return dist


def goodness_of_fit(exact: dict[tuple, float], counts: dict[tuple, int]) -> tuple[float, int]:
    """The chi-square p-value of sampled sequences' counts against their exact probabilities
    (`exact_distribution`), outcomes too rare for the approximation (fewer than 5 expected)
    merged into one cell; and how many cells stood apart."""
    from scipy.stats import chisquare

    samples = sum(counts.values())
    common = [k for k, p in exact.items() if p * samples >= 5]
    observed = [counts[k] for k in common] + [samples - sum(counts[k] for k in common)]
    expected = [exact[k] * samples for k in common] + [samples * (1 - sum(exact[k] for k in common))]
    return chisquare(observed, expected).pvalue, len(common)
