"""Model configuration: one flat dataclass that every family reads what it needs from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from verispec.errors import CorruptModelError
from verispec.values import is_whole


def _check_positive(name: str, value: Any) -> None:
    if not is_whole(value, 1):
        raise CorruptModelError(f"{name} must be a positive whole number, not {value!r}")


@dataclass
class ModelConfig:
    model_type: str  # family key, e.g. "qwen2", "llama", "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    intermediate_size: int = 0
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 has them)
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
    hidden_act: str = "silu"
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # anything family-specific that has no field above (hybrid layer layouts, ...)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            _check_positive(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise CorruptModelError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                                    f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive("head_dim", self.head_dim)

    @property
    def eos_token_ids(self) -> set[int]:
        if self.eos_token_id is None:
            return set()
        if isinstance(self.eos_token_id, int):
            return {self.eos_token_id}
        return set(self.eos_token_id)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict, ignoring keys no family uses."""
        data = dict(raw)
        if "text_config" in data and isinstance(data["text_config"], dict):
            # image-text checkpoints keep the language model's settings here
            text = dict(data["text_config"])
            text.setdefault("model_type", data.get("model_type"))
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in data and key not in text:
                    text[key] = data[key]
            data = text
        model_type = data.get("model_type", "")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and k != "extra"}
        if "rope_parameters" in data and isinstance(data["rope_parameters"], dict):
            # newer transformers nest rope settings; fold them back to the flat form
            params = dict(data["rope_parameters"])
            kwargs.setdefault("rope_theta", params.get("rope_theta", 10000.0))
            if "partial_rotary_factor" in params:
                kwargs.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
            if params.get("rope_type", "default") != "default":
                kwargs.setdefault("rope_scaling", params)
        if kwargs.get("rope_scaling") and kwargs["rope_scaling"].get(
                "rope_type", kwargs["rope_scaling"].get("type")) in (None, "default"):
            kwargs["rope_scaling"] = None
        if model_type in ("qwen3", "qwen3_moe"):
            kwargs["qk_norm"] = True
        if model_type in ("qwen2", "qwen2_moe"):
            kwargs.setdefault("attention_bias", bool(data.get("qkv_bias", True)))
        if "num_local_experts" in data:  # Mixtral, and Qwen3-MoE as transformers 5 saves it
            kwargs.setdefault("num_experts", data["num_local_experts"])
        if model_type == "mixtral":
            kwargs["moe_intermediate_size"] = data.get("intermediate_size", 0)
            kwargs["norm_topk_prob"] = True
        if "num_experts" in data and model_type == "qwen2_moe":
            kwargs.setdefault("norm_topk_prob", data.get("norm_topk_prob", False))
        kwargs["model_type"] = model_type
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise CorruptModelError(f"no {', '.join(missing)} in the model's settings")
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**kwargs, extra=extra)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def draft_format(target_weights: str | None, draft_weights: str | None) -> str | None:
    """A draft's weight format: its own if one is given, else the target's. The draft's format
    sets only its cost and how often it is right, never the output, and a float32 draft beside
    a quantised target can cost about as much per step as the target itself."""
    return draft_weights or target_weights
