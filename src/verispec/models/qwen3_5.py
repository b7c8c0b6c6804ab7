"""Hybrid decoders: Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next (text models).

Most layers are gated delta-net layers (linear attention with a recurrent state);
every few layers (config `layer_types`, by default every 4th) is gated full attention.

    block          x + mixer(norm(x)), then x + mlp(norm(x)); the norms are (1 + weight) RMSNorms
    delta-net      in_proj -> [q k v | z | b | a]; q, k, v through a causal depthwise conv (K = 4)
                   and SiLU; q, k l2-normalised, q scaled by Dk^-1/2; each k head serves
                   Hv / Hk value heads; decay g = -exp(A_log) * softplus(a + dt_bias),
                   beta = sigmoid(b); the gated delta rule (hybrid_cache.py); then an RMSNorm
                   of each head's output times silu(z), and out_proj
    attention      q_proj gives per head [query | gate]; q/k (1 + weight) RMSNorm; rotary on the
                   first partial_rotary_factor of each head; output * sigmoid(gate) -> o_proj
    mlp            SwiGLU (qwen3_5), or a sparse MoE with a sigmoid-gated shared expert
                   (qwen3_5_moe on every layer, renormalised top k; qwen3_next where the
                   config's decoder_sparse_step / mlp_only_layers say)

Qwen3.5 text rotary is "interleaved mrope"; with text only, its three position axes
carry the same position, which is plain rotary.

Weights: Hugging Face names, except that each delta-net layer's input projections are
one matrix `linear_attn.in_proj` (rows q, k, v, z, b, a: one read of the weights per
step). `sanitize` builds it from Qwen3.5's in_proj_qkv/_z/_b/_a, or from Qwen3-Next's
in_proj_qkvz/_ba, whose rows are grouped per key head. It also reads image-text
checkpoints (weights under `model.language_model.`, vision and MTP weights dropped),
expert weights in any layout moe.py knows, and llama.cpp's GGUF layout (gguf_tensor_to_hf).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.errors import CorruptModelError
from verispec.models.common import VERIFY_PASS_MAX, SwiGLU, apply_rope, attend
from verispec.models.dense import CausalLM
from verispec.models.hybrid_cache import DeltaNetShape, HybridCache, PassRecord, delta_rule, l2_normalize
from verispec.models.moe import ExpertAccounting, MoeCausalLM, SparseMoeBlock, is_sparse_layer

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(config: ModelConfig) -> list[str]:
    kinds = config.extra.get("layer_types")
    if kinds is None:
        interval = int(config.extra.get("full_attention_interval", 4))
        kinds = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(config.num_hidden_layers)]
    if len(kinds) != config.num_hidden_layers or set(kinds) - {LINEAR, FULL}:
        raise CorruptModelError(f"layer_types {kinds} do not describe {config.num_hidden_layers} "
                                f"layers of {LINEAR!r} / {FULL!r}")
    return list(kinds)


def delta_net_shape(config: ModelConfig) -> DeltaNetShape:
    e = config.extra
    return DeltaNetShape(key_heads=int(e.get("linear_num_key_heads", 16)),
                         value_heads=int(e.get("linear_num_value_heads", 32)),
                         key_dim=int(e.get("linear_key_head_dim", 128)),
                         value_dim=int(e.get("linear_value_head_dim", 128)),
                         conv_kernel=int(e.get("linear_conv_kernel_dim", 4)))


# ---------------------------------------------------------------- norms

class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in float32: weights are stored as offsets from 1."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight) of each head's output, times silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


# ---------------------------------------------------------------- token mixers

def causal_depthwise_conv(window: torch.Tensor, weight: torch.Tensor, length: int) -> torch.Tensor:
    """The last `length` outputs of a per-channel convolution over window [B, C, K-1+T], weight [C, 1, K].

    K shifted multiply-adds: for the few positions of a decoding step this avoids
    conv1d's kernel set-up, which costs more than the arithmetic.
    """
    taps = weight.shape[-1]
    out = window[:, :, :length] * weight[:, :, 0]
    for j in range(1, taps):
        out = out + window[:, :, j:j + length] * weight[:, :, j]
    return out


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; `slot` indexes the delta-net layers in the cache."""

    def __init__(self, config: ModelConfig, shape: DeltaNetShape, slot: int):
        super().__init__()
        self.shape, self.slot = shape, slot
        self.value_width = shape.value_heads * shape.value_dim
        self.in_proj = nn.Linear(config.hidden_size, shape.conv_channels + self.value_width
                                 + 2 * shape.value_heads, bias=False)
        channels = shape.conv_channels
        self.conv1d = nn.Conv1d(channels, channels, shape.conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(shape.value_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.value_heads))
        self.norm = GatedRMSNorm(shape.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        projected = self.in_proj(x)
        length = x.shape[1]
        if x.device.type == "cpu" and 1 < length <= VERIFY_PASS_MAX:
            # a verification pass mixes position by position, each exactly as a plain step
            # does: the batched form rounds differently (the projections stay batched)
            mixed = torch.cat([self._mix(projected[:, t:t + 1], cache) for t in range(length)], dim=1)
        else:
            mixed = self._mix(projected, cache)
        return self.out_proj(mixed)

    def _mix(self, projected: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Convolution, delta rule and gated norm over in_proj's output [B, T, ...] -> [B, T, Hv*Dv]."""
        batch, length, _ = projected.shape
        s = self.shape
        mixed, z, b, a = projected.split(
            [s.conv_channels, self.value_width, s.value_heads, s.value_heads], dim=-1)
        conv_window, state = cache.linear_state(self.slot)
        conv_inputs = mixed.transpose(1, 2)
        window = torch.cat([conv_window, conv_inputs], dim=2)  # [B, C, K-1+T]: no padding needed
        convolved = F.silu(causal_depthwise_conv(window, self.conv1d.weight, length)).transpose(1, 2)
        q, k, v = convolved.split([s.key_heads * s.key_dim, s.key_heads * s.key_dim, self.value_width], dim=-1)

        def heads(t: torch.Tensor, count: int, dim: int) -> torch.Tensor:  # -> [B, H, T, D], float32
            return t.reshape(batch, length, count, dim).transpose(1, 2).float()

        q = l2_normalize(heads(q, s.key_heads, s.key_dim)) * s.key_dim ** -0.5
        k = l2_normalize(heads(k, s.key_heads, s.key_dim))
        v = heads(v, s.value_heads, s.value_dim)
        decay = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).transpose(1, 2)
        beta = b.sigmoid().float().transpose(1, 2)
        repeat = s.value_heads // s.key_heads
        out, state = delta_rule(q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1),
                                v, decay, beta, state)
        cache.update_linear(self.slot, window[:, :, window.shape[2] - (s.conv_kernel - 1):], state,
                            PassRecord(conv_inputs, k, v, decay, beta))
        out = out.transpose(1, 2).to(projected.dtype)  # [B, T, Hv, Dv]
        out = self.norm(out, z.reshape(batch, length, s.value_heads, s.value_dim))
        return out.reshape(batch, length, self.value_width)


class GatedAttention(nn.Module):
    """Grouped-query attention with (1 + weight) q/k norms, partial rotary and a sigmoid output gate."""

    def __init__(self, config: ModelConfig, slot: int):
        super().__init__()
        self.slot = slot  # index among the attention layers: the KV cache holds only those
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)  # query and gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HybridCache,
                start: int) -> torch.Tensor:
        batch, length, _ = x.shape
        q, gate = self.q_proj(x).view(batch, length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin).to(v.dtype)
        keys, values = cache.write(self.slot, start, k, v)
        out = attend(q, keys, values, start)
        out = out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate.reshape(batch, length, -1))
        return self.o_proj(out)


# ---------------------------------------------------------------- the model

class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x, cos, sin, cache, start):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, cache) if self.is_linear else self.self_attn(h, cos, sin, cache, start))
        return x + self.mlp(self.post_attention_layernorm(x))


def _mlp(config: ModelConfig, layer_index: int) -> nn.Module:
    family = config.model_type
    if family.startswith("qwen3_5_moe"):  # every layer sparse; top-k weights always renormalised
        return SparseMoeBlock(dataclasses.replace(config, norm_topk_prob=True))
    if family == "qwen3_next" and config.num_experts and is_sparse_layer(config, layer_index):
        return SparseMoeBlock(config)
    return SwiGLU(config.hidden_size, config.intermediate_size)


class HybridCausalLM(ExpertAccounting, CausalLM):
    """Gated delta-net and gated attention layers over a HybridCache; see the module notes."""

    def __init__(self, config: ModelConfig):
        kinds, shape = layer_types(config), delta_net_shape(config)
        if shape.value_heads % shape.key_heads:
            raise CorruptModelError(f"{shape.value_heads} value heads cannot share "
                                    f"{shape.key_heads} key heads evenly")
        layers, slots = [], {LINEAR: 0, FULL: 0}
        for i, kind in enumerate(kinds):
            slot = slots[kind]
            mixer = GatedDeltaNet(config, shape, slot) if kind == LINEAR else GatedAttention(config, slot)
            slots[kind] += 1
            layers.append(HybridDecoderLayer(config, mixer, _mlp(config, i)))
        super().__init__(config, layers)
        self.kinds, self.shape = kinds, shape
        self.model.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    # -- cache
    def new_cache(self, max_len: int, batch: int = 1) -> HybridCache:
        self.ensure_rope(max_len)
        c = self.config
        return HybridCache(self.kinds.count(FULL), c.num_key_value_heads, c.head_dim, self.kinds.count(LINEAR),
                           self.shape, max_len, batch, self._state_dtype(), self.table().device,
                           kv_dtype=self.kv_dtype())

    def _state_dtype(self) -> torch.dtype:
        """The recurrent and convolution states' type: the activations'."""
        ref = self.table()
        return ref.dtype if ref.dtype.is_floating_point else torch.float32

    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self._state_dtype()

    def forward(self, tokens: torch.Tensor, cache: HybridCache, last_only: bool = False,
                outputs: int | None = None, extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        cache.begin_pass(tokens.shape[1])
        return super().forward(tokens, cache, last_only, outputs, extra_rows)

    # -- what the lab reads
    def state_bytes(self, batch: int = 1) -> int:
        """Bytes of recurrent and conv state one pass reads (and writes back), for `batch` sequences."""
        element = self.table().element_size()
        return self.kinds.count(LINEAR) * self.shape.state_bytes(element, batch)

    # -- loading
    def sanitize(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names and layouts -> this model's; moves tensors out of `state`."""
        state = _text_weights(state)
        for i, kind in enumerate(self.kinds):  # `state` may hold some layers only
            if kind == LINEAR and any(name.startswith(f"model.layers.{i}.linear_attn.") for name in state):
                _fuse_input_projections(state, f"model.layers.{i}.linear_attn.", self.shape)
        return MoeCausalLM.sanitize(state)


# ---------------------------------------------------------------- checkpoint layouts

_DROPPED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)")


def _text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's weights under `model.`; vision towers and MTP heads dropped."""
    out = {}
    for name in list(state):
        value = state.pop(name)
        if _DROPPED.match(name):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        out[name] = value
    return out


def _fuse_input_projections(state: dict[str, torch.Tensor], prefix: str, shape: DeltaNetShape) -> None:
    """Qwen3.5's four projections, or Qwen3-Next's two grouped ones -> one `in_proj` [q k v | z | b | a]."""
    if prefix + "in_proj.weight" in state:
        return
    if prefix + "in_proj_qkvz.weight" in state:
        parts = _ungroup_qwen3_next(state.pop(prefix + "in_proj_qkvz.weight"),
                                    state.pop(prefix + "in_proj_ba.weight"), shape)
    else:
        names = [prefix + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
        missing = [n for n in names if n not in state]
        if missing:
            raise CorruptModelError(f"delta-net weights missing: {', '.join(missing)}")
        parts = [state.pop(n) for n in names]
    state[prefix + "in_proj.weight"] = torch.cat(parts, dim=0)


def _ungroup_qwen3_next(qkvz: torch.Tensor, ba: torch.Tensor, shape: DeltaNetShape) -> list[torch.Tensor]:
    """Qwen3-Next stores rows per key head: [q, k, v (r heads), z (r heads)] x Hk, and [b (r), a (r)] x Hk.

    Returns [q k v (all heads, head-major), z, b, a], the rows Qwen3.5 keeps apart.
    """
    hk, r = shape.key_heads, shape.value_heads // shape.key_heads
    dk, dv = shape.key_dim, shape.value_dim
    hidden = qkvz.shape[-1]
    q, k, v, z = qkvz.view(hk, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
    q, k, v, z = (t.reshape(-1, hidden) for t in (q, k, v, z))
    return [torch.cat([q, k, v]), z, *_ungroup_qwen3_next_ba(ba, shape)]


def _ungroup_qwen3_next_ba(ba: torch.Tensor, shape: DeltaNetShape) -> tuple[torch.Tensor, torch.Tensor]:
    r = shape.value_heads // shape.key_heads
    b, a = ba.view(shape.key_heads, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(shape.value_heads, -1), a.reshape(shape.value_heads, -1)


# ---------------------------------------------------------------- GGUF (llama.cpp's converter, inverted)

GGUF_ARCHITECTURES = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}

_GGUF_BLOCK = {
    "attn_norm": "input_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_qkv": "linear_attn.in_proj_qkv.weight",
    "attn_gate": "linear_attn.in_proj_z.weight",
    "ssm_beta": "linear_attn.in_proj_b.weight",
    "ssm_alpha": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d.weight",
    "ssm_norm": "linear_attn.norm.weight",
    "ssm_out": "linear_attn.out_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight",
             "output": "lm_head.weight"}
# llama.cpp stores the (1 + weight) norms with the 1 added
_ONE_ADDED = {"attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm"}
# per-value-head tensors Qwen3.5 files keep in llama.cpp's tiled head order: (dimension, head size)
_TILED = {"attn_gate": (0, "value"), "ssm_beta": (0, 1), "ssm_alpha": (0, 1), "ssm_a": (0, 1),
          "ssm_dt": (0, 1), "ssm_out": (1, "value")}
_GGUF_NAME = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?")


def gguf_config_fields(meta: dict, arch: str) -> dict:
    """The ModelConfig fields these architectures need beyond the common GGUF keys."""

    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    value_heads = int(get("ssm.time_step_rank"))
    extra = {"linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
             "linear_key_head_dim": int(get("ssm.state_size")),
             "linear_num_key_heads": int(get("ssm.group_count")),
             "linear_num_value_heads": value_heads,
             "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
             "full_attention_interval": int(get("full_attention_interval", 4))}
    return {"extra": extra, "norm_topk_prob": True}  # llama.cpp renormalises these experts' top-k weights


def gguf_tensor_to_hf(gguf_name: str, value: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One dequantised GGUF tensor -> Hugging Face name(s) and layout; [] for tensors the text model lacks.

    Undoes llama.cpp's conversion: the 1 added to (1 + weight) norms, A stored as
    -exp(A_log), the conv kernel's squeezed axis, and in Qwen3.5 files the value
    heads reordered from grouped-per-key-head to tiled. Qwen3-Next's ssm_ba keeps
    the per-key-head grouping of in_proj_ba and is split here.
    """
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GGUF_TOP and suffix == "weight":
        return [(_GGUF_TOP[base], value - 1 if base in _ONE_ADDED else value)]
    match = _GGUF_NAME.fullmatch(gguf_name)
    if match is None:
        return []
    layer, part, _ = match.groups()
    prefix = f"model.layers.{layer}."
    shape = delta_net_shape(config)
    if part == "ssm_ba":
        b, a = _ungroup_qwen3_next_ba(value, shape)
        return [(prefix + "linear_attn.in_proj_b.weight", b), (prefix + "linear_attn.in_proj_a.weight", a)]
    if part not in _GGUF_BLOCK:
        return []
    if part in _ONE_ADDED:
        value = value - 1
    elif part == "ssm_a":
        value = torch.log(-value)
    elif part == "ssm_conv1d":
        value = value.unsqueeze(1)
    if config.model_type.startswith("qwen3_5") and shape.value_heads != shape.key_heads:
        value = _untile(part, value, shape)
    return [(prefix + _GGUF_BLOCK[part], value)]


def _untile(part: str, value: torch.Tensor, shape: DeltaNetShape) -> torch.Tensor:
    """Value heads from llama.cpp's tiled order [v0 of each key head, v1 of each, ...] back to grouped."""
    if part in ("attn_qkv", "ssm_conv1d"):  # q and k rows (channels) first, then the value heads
        keys = 2 * shape.key_heads * shape.key_dim
        return torch.cat([value[:keys], _untile_axis(value[keys:], 0, shape, shape.value_dim)])
    if part not in _TILED:
        return value
    axis, size = _TILED[part]
    return _untile_axis(value, axis, shape, shape.value_dim if size == "value" else size)


def _untile_axis(value: torch.Tensor, axis: int, shape: DeltaNetShape, head_size: int) -> torch.Tensor:
    per_key = shape.value_heads // shape.key_heads
    dims = list(value.shape)
    tiled = value.reshape(*dims[:axis], per_key, shape.key_heads, head_size, *dims[axis + 1:])
    return tiled.transpose(axis, axis + 1).reshape(dims)
