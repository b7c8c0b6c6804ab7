"""Model families, one file each. `build_model` picks the family from config.model_type."""

from __future__ import annotations

from torch import nn

from verispec.config import ModelConfig
from verispec.errors import UnsupportedArchitectureError


def _dense(config: ModelConfig) -> nn.Module:
    from verispec.models.dense import CausalLM
    return CausalLM(config)


def _moe(config: ModelConfig) -> nn.Module:
    from verispec.models.moe import MoeCausalLM
    return MoeCausalLM(config)


def _hybrid(config: ModelConfig) -> nn.Module:
    from verispec.models.qwen3_5 import HybridCausalLM
    return HybridCausalLM(config)


FAMILIES = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    # hybrids: gated delta-net + gated attention (image-text checkpoints name their text part *_text)
    "qwen3_5": _hybrid,
    "qwen3_5_text": _hybrid,
    "qwen3_5_moe": _hybrid,
    "qwen3_5_moe_text": _hybrid,
    "qwen3_next": _hybrid,
    "qwen2_moe": _moe,
    "qwen3_moe": _moe,
    "mixtral": _moe,
}


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def check_supported(config: ModelConfig) -> None:
    if config.model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"architecture {config.model_type!r} is not supported; "
            f"supported: {', '.join(supported_families())}")


def build_model(config: ModelConfig) -> nn.Module:
    check_supported(config)
    return FAMILIES[config.model_type](config)
