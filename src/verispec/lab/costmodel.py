"""Predict the speed-up of speculative decoding from first principles.

The formulas (BRIEF §1; Leviathan et al. 2023), with α the probability that the
target keeps a draft token, c = t_draft(1) / t_target(1) and r(m) = t_target(m) / t_target(1):

    E[tokens per cycle] = (1 - α^(γ+1)) / (1 - α)
    speed-up            = E / (γ·c + r(γ+1))
    distinct experts    = E_n · (1 - (1 - k/E_n)^m)     (m positions, top-k of E_n experts, uniform routing)

A pass over m positions is costed with a roofline: it reads the weights once
(for a mixture of experts, the dense part plus every distinct expert its m
positions touch), the KV cache and any recurrent state, and does m positions'
worth of FLOPs:

    t(m) = max(bytes(m) / bandwidth, m · flops_per_position / peak) + overhead

Costs come either from that roofline (`RooflineCosts`, from model shapes and a
`Hardware`) or from measurements (`MeasuredCosts`, from `verispec calibrate`).

The API the lab uses:

    predict_speedup(alpha, gamma, c, r_of_m, draft_r2=1.0, prompt_cost=0.0) -> float
        r_of_m: a callable m -> r(m), a sequence [r(1), r(2), ...] or a mapping {m: r(m)}.
        draft_r2 = t_draft(2) / t_draft(1): after a fully kept round (probability α^γ)
        verispec's draft feeds the last draft and the bonus token together, so that
        step costs a two-position pass; 1.0 gives the textbook γ·c.
        prompt_cost: the draft's reading of the prompt, in target steps per decoded
        token (see `draft_prompt_cost`). A draft model must read the prompt before it can
        draft, once per request; the textbook formula leaves it out, and for a
        request of a hundred tokens after a prompt of a hundred it is worth ~10%.
    predict(costs, alpha, gamma) -> Prediction (baseline and speculative tok/s, speed-up)
    alpha_from_counts(accepted, rejected) -> α
        SpecStats.acceptance_rate (accepted / drafted) is not α: after the first
        rejection the rest of a round's drafts count as drafted but were never
        judged. Estimate α as accepted / (accepted + rejections) instead, where
        rejections = SpecStats.recovered.
    verispec.lab.calibrate.load_profile(path).costs() -> MeasuredCosts
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from verispec.config import ModelConfig, draft_format
from verispec.errors import VerispecError
from verispec.spec.gamma import expected_tokens

__all__ = [
    "expected_tokens", "draft_cost", "speedup", "draft_prompt_cost", "predict_speedup", "expected_distinct_experts", "alpha_from_counts",
    "WeightFormat", "WEIGHT_FORMATS", "ModelShape", "shape_from_config", "Hardware", "HARDWARE",
    "MODEL_PRESETS", "model_preset", "hardware_preset", "shape_from_gguf", "shape_from_hf_folder",
    "shape_from_loaded", "resolve_shape", "PassCost", "RooflineCosts", "MeasuredCosts",
    "Prediction", "predict", "best_gamma", "slowdown_reason",
]

# the grid `verispec explain` prints
ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9)
GAMMAS = (1, 2, 4, 8, 16)


# ---------------------------------------------------------------- the formulas

def draft_cost(alpha: float, gamma: int, c: float, draft_r2: float = 1.0) -> float:
    """Expected drafting cost of a cycle in target steps: γ·c, with the first step a
    two-position pass after a fully kept round (probability α^γ)."""
    return c * (gamma + alpha ** gamma * (draft_r2 - 1.0))


def speedup(alpha: float, gamma: int, c: float, r_next: float, draft_r2: float = 1.0,
            prompt_cost: float = 0.0) -> float:
    """Speed-up over plain decoding, given r(γ+1) as a number: a token costs a cycle's
    cost over its expected tokens, plus its share of the draft's prompt reading."""
    tokens = expected_tokens(alpha, gamma)
    return 1.0 / ((draft_cost(alpha, gamma, c, draft_r2) + r_next) / tokens + prompt_cost)


def draft_prompt_cost(draft_prefill_s: float, target_step_s: float, decoded_tokens: float) -> float:
    """The draft's prompt reading in target steps per decoded token: a request's one-off
    draft prefill spread over the tokens it decodes (those after the first)."""
    if decoded_tokens <= 0 or target_step_s <= 0:
        return 0.0
    return draft_prefill_s / target_step_s / decoded_tokens


def _r_lookup(r_of_m: Callable[[int], float] | Sequence[float] | Mapping[int, float]) -> Callable[[int], float]:
    if callable(r_of_m):
        return r_of_m
    if isinstance(r_of_m, Mapping):
        return lambda m: r_of_m[m]
    return lambda m: r_of_m[m - 1]


def predict_speedup(alpha: float, gamma: int, c: float,
                    r_of_m: Callable[[int], float] | Sequence[float] | Mapping[int, float],
                    draft_r2: float = 1.0, prompt_cost: float = 0.0) -> float:
    """E[tokens per cycle] / (γ·c + r(γ+1)), less the draft's prompt reading; γ = 0 is
    plain decoding (1.0)."""
    if gamma == 0:
        return 1.0
    return speedup(alpha, gamma, c, _r_lookup(r_of_m)(gamma + 1), draft_r2, prompt_cost)


def expected_distinct_experts(num_experts: int, top_k: int, positions: int) -> float:
    """Distinct experts that `positions` tokens touch in one layer, if routing were uniform."""
    if num_experts <= 0 or top_k <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** positions)


def alpha_from_counts(accepted: int, rejected: int) -> float:
    """Per-token acceptance α from kept drafts and rejections (rounds that ended at a rejected draft)."""
    judged = accepted + rejected
    return accepted / judged if judged else 0.0


# ---------------------------------------------------------------- weight formats

@dataclass(frozen=True)
class WeightFormat:
    name: str
    bits: int  # per weight, before scales
    group: int = 0  # weights that share one scale (0: no scales)
    scale_bytes: int = 0  # bytes of scale (and zero point) per group
    head: str | None = None  # format of the output head, when the engine leaves it unquantised

    @property
    def bytes_per_weight(self) -> float:
        return self.bits / 8 + (self.scale_bytes / self.group if self.group else 0.0)


WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("float32", 32),
    WeightFormat("bfloat16", 16),
    WeightFormat("float16", 16),
    # verispec's int8: one float32 scale per output row (rows of ~2k weights); lm_head stays float32
    WeightFormat("int8", 8, 2048, 4, head="float32"),
    # verispec's int4: groups of 32 with a bfloat16 scale and zero point; lm_head stays float32
    WeightFormat("int4", 4, 32, 4, head="float32"),
    # int4 with int8 where the GGUF file stores more bits; the mix is the file's (this is its floor)
    WeightFormat("int4-mixed", 4, 32, 4, head="int8"),
    # llama.cpp block formats, for GGUF-served settings: Q8_0 = 34 bytes / 32 weights,
    # Q4_K = 144 bytes / 256 weights (Q4_K_M mixes in some Q6_K; this is its floor)
    WeightFormat("q8_0", 8, 32, 2),
    WeightFormat("q4_k", 4, 256, 16),
)}


def weight_format(name: str) -> WeightFormat:
    if name not in WEIGHT_FORMATS:
        raise VerispecError(f"unknown weight format {name!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[name]


# ---------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class ModelShape:
    """What a pass of a model reads and computes, in parameter counts and cache sizes."""

    name: str
    body_params: int  # read by every pass: attention, dense MLPs, shared experts, routers, norms
    head_params: int  # the output projection (the embedding itself when tied)
    embedding_params: int = 0  # a separate input table: only m rows are read, so not costed per pass
    expert_params: int = 0  # one routed expert in one MoE layer
    num_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    attention_layers: int = 0  # layers that keep a KV cache
    attention_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    recurrent_state_bytes: int = 0  # per sequence (hybrid models): read and written once per pass
    recurrent_flops: int = 0  # per position, for the recurrent layers' state update
    default_weights: str = "float32"
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def total_params(self) -> int:
        return (self.body_params + self.head_params + self.embedding_params
                + self.moe_layers * self.num_experts * self.expert_params)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with (embedding lookup excluded)."""
        return self.body_params + self.head_params + self.moe_layers * self.experts_per_token * self.expert_params

    def distinct_experts(self, positions: int) -> float:
        return expected_distinct_experts(self.num_experts, self.experts_per_token, positions)

    def weight_bytes(self, positions: int, fmt: WeightFormat) -> float:
        """Weight bytes one pass over `positions` reads."""
        head_fmt = WEIGHT_FORMATS[fmt.head] if fmt.head else fmt
        experts = self.moe_layers * self.distinct_experts(positions) * self.expert_params
        return (self.body_params + experts) * fmt.bytes_per_weight + self.head_params * head_fmt.bytes_per_weight

    def kv_bytes(self, context: int, positions: int, element_bytes: int) -> float:
        """KV cache bytes a pass touches: reads the context, writes the new positions."""
        per_position = 2 * self.attention_layers * self.kv_heads * self.head_dim * element_bytes
        return per_position * (context + positions)

    def flops_per_position(self, context: int) -> float:
        """2 FLOPs per active weight, plus attention over the context and the recurrent update."""
        attention = 4 * self.attention_layers * self.attention_heads * self.head_dim * context
        return 2 * self.active_params + attention + self.recurrent_flops


def _layer_kinds(config: ModelConfig) -> list[str]:
    """'attention' or 'linear' per layer (hybrid models name theirs in layer_types)."""
    extra = config.extra
    layers = config.num_hidden_layers
    if isinstance(extra.get("layer_types"), list):
        return ["linear" if "linear" in str(kind) else "attention" for kind in extra["layer_types"][:layers]]
    interval = extra.get("full_attention_interval")
    if interval and extra.get("linear_num_value_heads"):
        return ["attention" if (i + 1) % int(interval) == 0 else "linear" for i in range(layers)]
    return ["attention"] * layers


def _is_moe_layer(config: ModelConfig, index: int) -> bool:
    step = max(1, config.decoder_sparse_step or 1)
    return config.num_experts > 0 and index not in config.mlp_only_layers and (index + 1) % step == 0


def _attention_params(config: ModelConfig) -> int:
    hidden, heads, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q_out = heads * hd * (2 if config.extra.get("attn_output_gate") else 1)  # gated attention doubles q_proj
    params = hidden * (q_out + 2 * kv * hd) + heads * hd * hidden
    if config.attention_bias:
        params += q_out + 2 * kv * hd
    if config.qk_norm:
        params += 2 * hd
    return params


def _linear_attention(config: ModelConfig) -> tuple[int, int, int]:
    """(params, state bytes, FLOPs per position) of one gated-delta-net layer (Qwen3-Next/Qwen3.5 names)."""
    extra = config.extra
    nk, nv = int(extra.get("linear_num_key_heads", 0)), int(extra.get("linear_num_value_heads", 0))
    dk, dv = int(extra.get("linear_key_head_dim", 128)), int(extra.get("linear_value_head_dim", 128))
    kernel = int(extra.get("linear_conv_kernel_dim", 4))
    hidden = config.hidden_size
    conv_channels = 2 * nk * dk + nv * dv
    params = hidden * (conv_channels + nv * dv + 2 * nv) + conv_channels * kernel + nv * dv * hidden + 2 * nv + dv
    state_bytes = nv * dk * dv * 4 + conv_channels * (kernel - 1) * 2  # float32 state, 16-bit conv window
    flops = 6 * nv * dk * dv  # read-out, decay and delta update of a dk×dv state per value head
    return params, state_bytes, flops


def shape_from_config(config: ModelConfig, name: str = "", default_weights: str = "float32",
                      source: str = "") -> ModelShape:
    """Parameter counts of a decoder from its configuration (dense, MoE or hybrid)."""
    hidden = config.hidden_size
    kinds = _layer_kinds(config)
    linear_params, state_bytes, linear_flops = _linear_attention(config) if "linear" in kinds else (0, 0, 0)
    body = hidden  # final norm
    moe_layers = 0
    for index, kind in enumerate(kinds):
        body += 2 * hidden  # the two norms
        body += _attention_params(config) if kind == "attention" else linear_params
        if _is_moe_layer(config, index):
            moe_layers += 1
            body += hidden * config.num_experts  # router
            if config.shared_expert_intermediate_size:
                body += 3 * hidden * config.shared_expert_intermediate_size + hidden  # shared expert and its gate
        else:
            body += 3 * hidden * config.intermediate_size
    table = config.vocab_size * hidden
    linear_layers = kinds.count("linear")
    return ModelShape(
        name=name or config.model_type,
        body_params=body,
        head_params=table,
        embedding_params=0 if config.tie_word_embeddings else table,
        expert_params=3 * hidden * config.moe_intermediate_size if config.num_experts else 0,
        num_experts=config.num_experts,
        experts_per_token=config.num_experts_per_tok,
        moe_layers=moe_layers,
        attention_layers=kinds.count("attention"),
        attention_heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        recurrent_state_bytes=linear_layers * state_bytes,
        recurrent_flops=linear_layers * linear_flops,
        default_weights=default_weights,
        source=source,
    )


# ---------------------------------------------------------------- presets of public shapes

@dataclass(frozen=True)
class ModelPreset:
    config: dict[str, Any]  # Hugging Face config.json keys
    weights: str
    source: str


_QWEN35_HYBRID = dict(
    head_dim=256, attn_output_gate=True, full_attention_interval=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, tie_word_embeddings=True)

MODEL_PRESETS: dict[str, ModelPreset] = {
    # The seed's setting: Qwen3.5 models under llama.cpp on an M2 Ultra (AtomGradient/speculative-moe-research).
    # Qwen3.5-35B-A3B: Qwen/Qwen3.5-35B-A3B config.json (40 layers, 3 gated-delta-net : 1 gated attention,
    # 256 routed experts of width 512, top-8, plus one shared expert); run as Q8_0.
    "seed-35b-a3b": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5_moe", hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        tie_word_embeddings=False), "q8_0", "Qwen/Qwen3.5-35B-A3B config.json"),
    # The same model as first described for this project: 128 routed experts, top-8. No such
    # shape keeps both 35B in all and 3B active; experts of width 1024 keep the 35B (3.9B
    # active). A verify pass over 9 positions touches ~56 of 128 experts per layer here.
    "seed-35b-a3b-128e": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5_moe", hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=512,
        tie_word_embeddings=False), "q8_0", "Qwen3.5-35B-A3B reshaped to 128 experts of width 1024 (as first described)"),
    # Qwen3.5-0.8B: Qwen/Qwen3.5-0.8B config.json (24 layers, hidden 1024, tied embeddings).
    "seed-0.8b": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
        tie_word_embeddings=True), "q8_0", "Qwen/Qwen3.5-0.8B config.json"),
    # Qwen3.5-2B: hidden 2048 is public; the other widths are estimated from the 0.8B/4B configs.
    "seed-2b": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
        tie_word_embeddings=True), "q8_0", "Qwen3.5-2B: hidden size public, other widths estimated"),
    # Qwen3.5-4B: Qwen/Qwen3.5-4B config.json (32 layers, hidden 2560, MLP 9216); bf16 as in the seed.
    "seed-4b": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5", hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32,
        tie_word_embeddings=True), "bfloat16", "Qwen/Qwen3.5-4B config.json"),
    # Qwen3.5-9B: Qwen/Qwen3.5-9B config.json (32 layers, hidden 4096, MLP 12288, untied); bf16 (17.9 GB).
    "seed-9b": ModelPreset(dict(
        _QWEN35_HYBRID, model_type="qwen3_5", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32,
        tie_word_embeddings=False), "bfloat16", "Qwen/Qwen3.5-9B config.json"),
    # The demo pair, as verispec runs it by default (dequantised to float32).
    "qwen2.5-coder-1.5b": ModelPreset(dict(
        _QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2), "float32", "Qwen/Qwen2.5-Coder-1.5B-Instruct config.json"),
    "qwen2.5-coder-0.5b": ModelPreset(dict(
        _QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2), "float32", "Qwen/Qwen2.5-Coder-0.5B-Instruct config.json"),
    # Qwen3-30B-A3B: 48 layers, 128 experts of width 768, top-8, no shared expert.
    "qwen3-30b-a3b": ModelPreset(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, tie_word_embeddings=False), "bfloat16", "Qwen/Qwen3-30B-A3B config.json"),
    "qwen3-0.6b": ModelPreset(dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
        "bfloat16", "Qwen/Qwen3-0.6B config.json"),
    # An 8B dense target and a 1B draft that shares its tokenizer.
    "llama3.1-8b": ModelPreset(dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
        "bfloat16", "meta-llama/Llama-3.1-8B config.json"),
    "llama3.2-1b": ModelPreset(dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
        "bfloat16", "meta-llama/Llama-3.2-1B config.json"),
}


def model_preset(name: str) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise VerispecError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    preset = MODEL_PRESETS[name]
    return shape_from_config(ModelConfig.from_hf(preset.config), name, preset.weights, preset.source)


# ---------------------------------------------------------------- shapes from files, without loading weights

_SKIPPED_TOWERS = ("visual", "vision", "audio", "mtp", "nextn")


def _count_by_role(tensors: list[tuple[str, int]], is_expert: Callable[[str], bool],
                   embedding: str, head: str) -> dict[str, int]:
    counts = {"body": 0, "table": 0, "head": 0, "experts": 0}
    for name, numel in tensors:
        if any(tower in name for tower in _SKIPPED_TOWERS):
            continue
        role = ("table" if embedding in name else "head" if head in name
                else "experts" if is_expert(name) else "body")
        counts[role] += numel
    return counts


def _with_counts(shape: ModelShape, counts: dict[str, int], source: str) -> ModelShape:
    """Replace the estimated parameter counts with the ones a checkpoint actually holds."""
    tied = counts["head"] == 0
    per_expert = shape.expert_params
    if shape.is_moe and counts["experts"]:
        per_expert = counts["experts"] // (shape.moe_layers * shape.num_experts)
    return replace(shape, body_params=counts["body"], head_params=counts["table"] if tied else counts["head"],
                   embedding_params=0 if tied else counts["table"], expert_params=per_expert, source=source)


def shape_from_gguf(path) -> ModelShape:
    """Shapes from a GGUF file's metadata and tensor table; no tensor data is read."""
    from pathlib import Path

    from verispec.loading.gguf_file import metadata, open_reader

    path = Path(path)
    reader = open_reader(path)
    meta = metadata(reader)
    arch = meta.get("general.architecture", "?")

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) else value  # per-layer lists (hybrids): the largest

    tensors = [(t.name, int(t.n_elements)) for t in reader.tensors]
    names = [name for name, _ in tensors]
    blocks = int(get("block_count", 0)) - int(get("nextn_predict_layers", 0) or 0)

    def layers_with(part: str) -> int:
        return len({n.split(".")[1] for n in names if n.startswith("blk.") and f".{part}" in n
                    and int(n.split(".")[1]) < blocks})

    heads = int(get("attention.head_count", 1))
    hidden = int(get("embedding_length", 0))
    inner, state = int(get("ssm.inner_size", 0) or 0), int(get("ssm.state_size", 0) or 0)
    kernel = int(get("ssm.conv_kernel", 4) or 4)
    conv = sum(n for name, n in tensors if name.endswith("ssm_conv1d.weight") and int(name.split(".")[1]) < blocks)
    recurrent_layers = layers_with("ssm_")
    shape = ModelShape(
        name=path.name, body_params=0, head_params=0,
        num_experts=int(get("expert_count", 0) or 0), experts_per_token=int(get("expert_used_count", 0) or 0),
        moe_layers=layers_with("ffn_gate_exps") or layers_with("ffn_up_exps"),
        attention_layers=layers_with("attn_k."), attention_heads=heads,
        kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", 0) or (hidden // heads if heads else 0)),
        recurrent_state_bytes=recurrent_layers * inner * state * 4 + conv * (kernel - 1) // kernel * 2,
        recurrent_flops=recurrent_layers * 6 * inner * state,
    )
    in_blocks = [(n, c) for n, c in tensors if not n.startswith("blk.") or int(n.split(".")[1]) < blocks]
    counts = _count_by_role(in_blocks, lambda n: "_exps" in n, "token_embd.", "output.weight")
    return _with_counts(shape, counts, f"GGUF tensor table of {path.name}")


def _safetensors_shapes(file) -> list[tuple[str, int]]:
    """(name, elements) of every tensor, from the file's JSON header alone."""
    import json
    import struct

    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise VerispecError(f"{file}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise VerispecError(f"{file}: implausible safetensors header of {size:,} bytes")
        try:
            header = json.loads(f.read(size))
        except json.JSONDecodeError as exc:
            raise VerispecError(f"{file}: unreadable safetensors header ({exc})") from None
    return [(name, math.prod(info["shape"])) for name, info in header.items() if name != "__metadata__"]


def shape_from_hf_folder(folder) -> ModelShape:
    """Shapes from config.json, with parameter counts from the safetensors headers when present."""
    from pathlib import Path

    from verispec.loading.hf_folder import read_config

    folder = Path(folder)
    config, _ = read_config(folder)
    shape = shape_from_config(config, folder.name, source=f"config.json of {folder.name}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return shape
    tensors = [t for file in files for t in _safetensors_shapes(file)]
    counts = _count_by_role(tensors, lambda n: ".experts." in n, "embed_tokens.", "lm_head.")
    return _with_counts(shape, counts, f"config.json and safetensors headers of {folder.name}")


def shape_from_loaded(loaded) -> ModelShape:
    """Shapes of a model verispec has loaded (a LoadedModel), in the format it runs."""
    return shape_from_config(loaded.config, loaded.name, loaded.weights, source="loaded model's config")


def resolve_shape(spec: str) -> ModelShape:
    """A model file or folder, an installed demo model, or a preset name -> its shapes."""
    from pathlib import Path

    from verispec.loading import resolve
    from verispec.loading.demo_models import DEMO_MODELS, model_path

    text = str(spec)
    is_file = Path(text).expanduser().exists() or (text in DEMO_MODELS and model_path(text).is_file())
    if not is_file and text in MODEL_PRESETS:
        return model_preset(text)
    if not is_file and text not in DEMO_MODELS:
        raise VerispecError(f"{text!r} is neither a model file or folder nor a preset; "
                            f"presets: {', '.join(MODEL_PRESETS)}")
    path = resolve(text)
    shape = shape_from_hf_folder(path) if path.is_dir() else shape_from_gguf(path)
    return replace(shape, name=text if text in DEMO_MODELS else shape.name)


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s the weights stream at
    peak_flops: float  # FLOP/s of the matrix units at the working precision
    overhead_s: float = 0.0  # fixed cost of any pass (dispatch, synchronisation)
    note: str = ""

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise VerispecError(f"bandwidth must be a positive number, got {self.bandwidth:g} bytes/s")
        if not (self.peak_flops > 0 and math.isfinite(self.peak_flops)):
            raise VerispecError(f"peak FLOP/s must be a positive number, got {self.peak_flops:g}")
        if self.overhead_s < 0:
            raise VerispecError(f"per-pass overhead must be >= 0, got {self.overhead_s:g} s")

    @property
    def ridge(self) -> float:
        """FLOPs per byte where a pass turns from memory-bound to compute-bound."""
        return self.peak_flops / self.bandwidth


HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    # this project's CPU machines (BRIEF §1): 20.1 GB/s read with 2 threads; the FLOP/s is an
    # AVX2-FMA estimate for 2 cores; `verispec calibrate` measures both
    Hardware("cpu", 20.1e9, 150e9, note="2-core AMD EPYC (AVX2); run `verispec calibrate` for this machine"),
    # the seed's machine: Apple M2 Ultra, 800 GB/s unified memory, ~27 TFLOP/s (76-core GPU)
    Hardware("m2-ultra", 800e9, 27.2e12, note="Apple M2 Ultra (the seed's machine)"),
    # measured on this workplace's H200s (BRIEF §1): ~4.3 TB/s copy, ~790 TFLOP/s bf16
    Hardware("h200", 4.3e12, 790e12, note="NVIDIA H200"),
)}


def hardware_preset(name: str) -> Hardware:
    if name not in HARDWARE:
        raise VerispecError(f"unknown hardware preset {name!r}; presets: {', '.join(HARDWARE)}")
    return HARDWARE[name]


# ---------------------------------------------------------------- costs of a pass

@dataclass(frozen=True)
class PassCost:
    positions: int
    weight_bytes: float
    cache_bytes: float  # KV cache plus recurrent state
    flops: float  # all positions together
    seconds: float
    bound: str  # "memory" or "compute"
    distinct_experts: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_bytes


class Costs(Protocol):
    """What a prediction needs: the target's step time, c, the draft's r(2) and the target's r(m)."""

    @property
    def target_step_s(self) -> float: ...

    @property
    def c(self) -> float: ...

    @property
    def draft_r2(self) -> float: ...

    def r(self, positions: int) -> float: ...


def _kv_element_bytes(fmt: WeightFormat) -> int:
    # the cache follows the activations: float32 beside float32 or verispec's int8/int4 weights, else 16-bit
    return 4 if fmt.name == "float32" or fmt.head == "float32" else 2


@dataclass(frozen=True)
class RooflineCosts:
    target: ModelShape
    draft: ModelShape | None
    hardware: Hardware
    target_weights: str | None = None  # None: the shape's default format
    draft_weights: str | None = None  # None: target_weights, as the engine loads a draft, else the shape's default
    context: int = 256  # tokens already in the cache

    def weight_format(self, shape: ModelShape) -> WeightFormat:
        if shape is self.target:
            chosen = self.target_weights
        else:
            chosen = draft_format(self.target_weights, self.draft_weights)
        return weight_format(chosen or shape.default_weights)

    def pass_cost(self, shape: ModelShape, positions: int) -> PassCost:
        fmt = self.weight_format(shape)
        weights = shape.weight_bytes(positions, fmt)
        cache = shape.kv_bytes(self.context, positions, _kv_element_bytes(fmt)) + 2 * shape.recurrent_state_bytes
        flops = positions * shape.flops_per_position(self.context)
        memory_s = (weights + cache) / self.hardware.bandwidth
        compute_s = flops / self.hardware.peak_flops
        return PassCost(positions, weights, cache, flops, max(memory_s, compute_s) + self.hardware.overhead_s,
                        "memory" if memory_s >= compute_s else "compute", shape.distinct_experts(positions))

    def t_target(self, positions: int) -> float:
        return self.pass_cost(self.target, positions).seconds

    @property
    def target_step_s(self) -> float:
        return self.t_target(1)

    @property
    def c(self) -> float:
        if self.draft is None:
            return 0.0
        return self.pass_cost(self.draft, 1).seconds / self.target_step_s

    @property
    def draft_r2(self) -> float:
        if self.draft is None:
            return 1.0
        return self.pass_cost(self.draft, 2).seconds / self.pass_cost(self.draft, 1).seconds

    def r(self, positions: int) -> float:
        return self.t_target(positions) / self.target_step_s


@dataclass(frozen=True)
class MeasuredCosts:
    """Costs measured on this machine: t_target(m) for m = 1.. and the draft's single step."""

    target_s: Mapping[int, float]  # m -> seconds of one target pass over m positions
    draft_step_s: float
    draft_two_s: float | None = None  # the draft's pass over two positions, when measured
    draft_prefill_s: Mapping[int, float] | None = None  # prompt length -> the draft's prefill seconds

    def __post_init__(self) -> None:
        if 1 not in self.target_s:
            raise VerispecError("measured costs need the target's single-position time t(1)")

    @property
    def target_step_s(self) -> float:
        return self.target_s[1]

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    @property
    def draft_r2(self) -> float:
        return self.draft_two_s / self.draft_step_s if self.draft_two_s and self.draft_step_s else 1.0

    def t_target(self, positions: int) -> float:
        """Measured, interpolated between measured sizes, or extrapolated along the last slope."""
        if positions in self.target_s:
            return self.target_s[positions]
        known = sorted(self.target_s)
        below = [m for m in known if m < positions]
        above = [m for m in known if m > positions]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (positions - lo) / (hi - lo)
            return self.target_s[lo] * (1 - w) + self.target_s[hi] * w
        if not below:
            return self.target_s[known[0]]
        lo = below[-1]
        prev = below[-2] if len(below) > 1 else lo
        slope = (self.target_s[lo] - self.target_s[prev]) / (lo - prev) if lo != prev else 0.0
        return self.target_s[lo] + max(slope, 0.0) * (positions - lo)

    def r(self, positions: int) -> float:
        return self.t_target(positions) / self.target_step_s

    def draft_prefill(self, prompt_tokens: float) -> float:
        """Seconds the draft spends reading a prompt of this length: linear between the
        measured lengths (a prefill's cost grows with its length), 0 when not measured."""
        if not self.draft_prefill_s:
            return 0.0
        known = sorted(self.draft_prefill_s)
        if len(known) == 1:
            return self.draft_prefill_s[known[0]] * prompt_tokens / known[0]
        i = min(max(bisect.bisect_left(known, prompt_tokens), 1), len(known) - 1)
        lo, hi = known[i - 1], known[i]
        slope = (self.draft_prefill_s[hi] - self.draft_prefill_s[lo]) / (hi - lo)
        return max(0.0, self.draft_prefill_s[lo] + slope * (prompt_tokens - lo))

    def prompt_cost(self, prompt_tokens: float, decoded_tokens: float) -> float:
        """The draft's prompt reading in target steps per decoded token (see `draft_prompt_cost`)."""
        return draft_prompt_cost(self.draft_prefill(prompt_tokens), self.target_step_s, decoded_tokens)


# ---------------------------------------------------------------- predictions

@dataclass(frozen=True)
class Prediction:
    alpha: float
    gamma: int
    expected_tokens: float  # per cycle
    draft_cost: float  # in target steps: γ·c (see draft_cost)
    r_next: float  # r(γ+1)
    speedup: float
    baseline_tps: float
    speculative_tps: float

    @property
    def cycle_cost(self) -> float:
        """A cycle's cost in target steps: γ·c + r(γ+1)."""
        return self.draft_cost + self.r_next


def predict(costs: Costs, alpha: float, gamma: int) -> Prediction:
    if not 0.0 <= alpha <= 1.0:
        raise VerispecError(f"acceptance α must be between 0 and 1, got {alpha:g}")
    if gamma < 0:
        raise VerispecError(f"γ must be >= 0, got {gamma}")
    baseline = 1.0 / costs.target_step_s
    if gamma == 0:
        return Prediction(alpha, 0, 1.0, 0.0, 1.0, 1.0, baseline, baseline)
    tokens = expected_tokens(alpha, gamma)
    drafting = draft_cost(alpha, gamma, costs.c, getattr(costs, "draft_r2", 1.0))
    r_next = costs.r(gamma + 1)
    rate = tokens / (drafting + r_next)
    return Prediction(alpha, gamma, tokens, drafting, r_next, rate, baseline, baseline * rate)


def best_gamma(costs: Costs, alpha: float, max_gamma: int = 16) -> Prediction:
    """The γ in 1..max_gamma with the highest predicted speed-up (which may still be below 1)."""
    return max((predict(costs, alpha, g) for g in range(1, max_gamma + 1)), key=lambda p: p.speedup)


def slowdown_reason(costs: Costs, prediction: Prediction) -> str | None:
    """One sentence on why speculation loses at this α and γ; None when it does not."""
    if prediction.speedup >= 1.0:
        return None
    g, m = prediction.gamma, prediction.gamma + 1
    sentence = (f"At α = {prediction.alpha:g} a cycle of γ = {g} yields {prediction.expected_tokens:.2f} "
                f"token(s) on average but costs γ·c + r(γ+1) = {prediction.draft_cost:.2f} + "
                f"{prediction.r_next:.2f} = {prediction.cycle_cost:.2f} target steps ({g} draft step(s) at "
                f"c = {costs.c:.3f}, then a verify pass over {m} positions), so it runs at "
                f"{prediction.speedup:.2f}× the target alone")
    if isinstance(costs, RooflineCosts) and costs.target.is_moe:
        shape = costs.target
        sentence += (f", and its verify pass over {m} positions touches ~{shape.distinct_experts(m):.0f} of "
                     f"{shape.num_experts} experts per layer against {shape.experts_per_token} for one token")
    return sentence + "."
