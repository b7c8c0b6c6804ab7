"""Load a single GGUF file: metadata -> ModelConfig, tensors -> Hugging Face names, tokenizer.

Tensors are dequantised with the `gguf` package. Quantised blocks can also be
kept as they are (`raw=True`) for the weight formats that read GGUF blocks directly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verispec.config import ModelConfig
from verispec.errors import CorruptModelError, UnsupportedArchitectureError
from verispec.loading.layer_order import in_layer_order
from verispec.quant import stored_as_floats

# GGUF architecture name -> our family key
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    # hybrids (gated delta-net + attention): their tensors follow their own layout
    "qwen35": "qwen3_5",
    "qwen35moe": "qwen3_5_moe",
    "qwen3next": "qwen3_next",
}
HYBRID_FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
DEQUANTIZE_ROWS = 4096

# per-block tensor names: GGUF -> Hugging Face
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if not match or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def open_reader(path: Path):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises many kinds on a damaged file
        raise CorruptModelError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise CorruptModelError(
                f"{path}: truncated: tensor {tensor.name} ends at byte {end:,} but the file has {size:,}")
    return reader


def metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            continue
        try:
            out[key] = field.contents()
        except Exception:
            continue
    return out


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int) -> ModelConfig:
    arch = meta.get("general.architecture", "?")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}")
    family = GGUF_ARCHITECTURES[arch]
    if family == "llama" and meta.get("llama.expert_count"):
        family = "mixtral"  # llama.cpp stores Mixtral as llama with experts
    elif family == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        family = "mistral"

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    def required(key: str) -> int:
        value = get(key)
        if value is None:
            raise CorruptModelError(f"no {arch}.{key} in the GGUF metadata")
        return int(value)

    heads = required("attention.head_count")
    hidden = required("embedding_length")
    if heads <= 0:
        raise CorruptModelError(f"{arch}.attention.head_count must be positive, not {heads}")
    head_dim = get("attention.key_length") or hidden // heads
    rope_dim = get("rope.dimension_count") or head_dim
    scaling = None
    kind = get("rope.scaling.type")
    if kind and kind != "none":
        scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length"):
            scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    layers = required("block_count")
    kwargs: dict[str, Any] = dict(
        model_type=family,
        vocab_size=vocab_rows,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        intermediate_size=int(get("feed_forward_length", 0) or 0),
        head_dim=int(head_dim),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        partial_rotary_factor=rope_dim / head_dim,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    if get("expert_count"):
        kwargs.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=required("expert_used_count"),
            # Mixtral (llama with experts) has no expert width of its own: its experts are the FFN
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or 0) or kwargs["intermediate_size"],
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0) or 0),
            norm_topk_prob=family in ("qwen3_moe", "mixtral") or bool(get("expert_weights_norm", False)),
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
        )
    if family in HYBRID_FAMILIES:
        from verispec.models.qwen3_5 import gguf_config_fields
        kwargs.update(gguf_config_fields(meta, arch))
    return ModelConfig(**kwargs)


def unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for the 'llama' architecture (interleaved rope)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def dequantize(tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    shape = tuple(int(d) for d in reversed(tensor.shape))
    if stored_as_floats(tensor):
        array = np.asarray(tensor.data)
        if tensor.tensor_type == GGMLQuantizationType.BF16:
            return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).float().reshape(shape)
        return torch.from_numpy(array.astype(np.float32)).reshape(shape)
    blocks = np.asarray(tensor.data)
    rows = blocks.reshape(-1, blocks.shape[-1]) if blocks.ndim > 1 else blocks.reshape(1, -1)
    out = np.empty((rows.shape[0], math.prod(shape) // rows.shape[0]), dtype=np.float32)
    # a few thousand rows at a time: gguf's decoder makes several float temporaries the size
    # of what it decodes, each 0.93 GB for the 1.5B demo model's output layer
    for first in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        out[first:first + DEQUANTIZE_ROWS] = quants.dequantize(rows[first:first + DEQUANTIZE_ROWS], tensor.tensor_type)
    return torch.from_numpy(out).reshape(shape)


def _packed_experts(name: str, stack: torch.Tensor, fmt: str, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One decoded expert stack, packed: its stored tensor, and its scales under the names
    `StackedExperts` gives them."""
    from verispec.models.moe import StackedExperts, expert_kind, pack_stack

    kind = expert_kind(fmt, config.hidden_size, config.moe_intermediate_size or config.intermediate_size)
    stored, extra = pack_stack(stack, fmt, kind)
    packed = {name: stored}
    if extra is not None:
        packed[name.removesuffix(".weight") + StackedExperts.EXTRA[kind][0]] = extra
    return packed


def read_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False, expert_format: str | None = None,
              embedding_blocks: bool = False
              ) -> tuple[ModelConfig, Iterator[dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
    """Returns (config, layers, metadata, quantized) for a GGUF file.

    `layers` yields the weights one decoder layer at a time, in order, then the rest
    (embedding, final norm, output layer), each decoded only when it is asked for: a caller
    that packs each layer before asking for the next holds one layer in float32, never the
    whole model (a 1.5B model in float32 is 7 GB).

    With `expert_format`, a mixture of experts' stacked experts are packed in that weight
    format as each is decoded (`models.moe.pack_stack`), so not even one layer's experts are
    held in float32 for long.

    `quantized` maps a Hugging Face weight name to its raw GGUF tensor (its blocks and its
    stored type): the token embedding's always, and every matrix's whose rows are stored in
    order when keep_quantized is set. A layer's entries are there once the layer is yielded.

    With `embedding_blocks`, for a caller that will look tokens up in the embedding's own
    blocks (`quant.GgufEmbedding`) wherever the file stores an output layer apart, such an
    embedding is not decoded: its weight is a stand-in of the right shape that holds no
    memory (it reads as zeros), where decoded it would be 0.93 GB for the 1.5B demo model.
    """
    reader = open_reader(path)
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise CorruptModelError(f"{path}: no token_embd.weight tensor")
    try:
        config = config_from_metadata(meta, names, int(embed.shape[1]))
    except CorruptModelError as exc:
        raise CorruptModelError(f"{path}: {exc}") from None
    quantized: dict[str, Any] = {}

    def decoded(tensors) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for tensor in tensors:
            if tensor is embed and embedding_blocks and _lookups_from_blocks(embed, config):
                quantized["model.embed_tokens.weight"] = embed
                state["model.embed_tokens.weight"] = torch.zeros((), dtype=dtype).expand(
                    config.vocab_size, config.hidden_size)
                continue
            state.update(_decoded_tensor(path, tensor, config, dtype, keep_quantized, expert_format, quantized))
        return state

    def layers() -> Iterator[dict[str, torch.Tensor]]:
        for tensors in in_layer_order(reader.tensors, lambda t: _BLOCK_INDEX.match(t.name)):
            yield decoded(tensors)

    return config, layers(), meta, quantized


def load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool = False, expert_format: str | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """`read_gguf` with every layer's weights in one state dict."""
    config, layers, meta, quantized = read_gguf(path, dtype, keep_quantized, expert_format)
    state: dict[str, torch.Tensor] = {}
    for layer in layers:
        state.update(layer)
    return config, state, meta, quantized


def _lookups_from_blocks(embed, config: ModelConfig) -> bool:
    """Whether the embedding serves lookups only (the file has an output layer of its own)
    and is stored in blocks that `quant.GgufEmbedding` can serve them from."""
    return (not config.tie_word_embeddings and config.model_type not in HYBRID_FAMILIES
            and not stored_as_floats(embed))


_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")


def _decoded_tensor(path: Path, tensor, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool,
                    expert_format: str | None, quantized: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One GGUF tensor as Hugging Face named tensors (none where verispec has no use for it)."""
    hybrid = config.model_type in HYBRID_FAMILIES
    name = hf_name(tensor.name)
    if name is None and not hybrid:
        return {}
    try:
        value = dequantize(tensor)
    except Exception as exc:
        raise CorruptModelError(f"{path}: tensor {tensor.name} could not be decoded: {exc}") from None
    if hybrid:
        from verispec.models.qwen3_5 import gguf_tensor_to_hf
        return {key: v.to(dtype) for key, v in gguf_tensor_to_hf(tensor.name, value, config)}
    if expert_format and value.dim() == 3 and ".mlp.experts." in name:
        return _packed_experts(name, value, expert_format, config)
    permute = config.model_type in ("llama", "mistral", "mixtral")  # the 'llama' architecture
    if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
        value = unpermute_qk(value, config.num_attention_heads)
    elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
        value = unpermute_qk(value, config.num_key_value_heads)
    elif (keep_quantized and value.dim() == 2) or name == "model.embed_tokens.weight":
        quantized[name] = tensor  # the embedding's blocks can serve lookups (quant.GgufEmbedding)
    return {name: value.to(dtype)}
