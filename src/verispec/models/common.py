"""Pieces every decoder family shares: norms, rotary embeddings, cached attention, SwiGLU."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from verispec.cache import CACHE_DTYPES, KVCache
from verispec.config import ModelConfig
from verispec.kernels import cpu_kernels
from verispec.quant import KERNEL_MAX_ROWS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # half precision: normalise in float32 as the reference implementations do
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * y.to(x.dtype)


# ---------------------------------------------------------------- rotary embeddings

def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_factor, high_factor = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_factor, old_len / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_len, rotary_dim] in float32, for every scaling variant we know.

    Supported `rope_type`s: default, linear, dynamic (NTK, frequencies fixed for the
    whole context we allocate), yarn and llama3.
    """
    dim = int(config.head_dim * config.partial_rotary_factor)
    base = float(config.rope_theta)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "dynamic":
        original = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
        if max_len > original:
            factor = scaling["factor"]
            base = base * ((factor * max_len / original) - (factor - 1)) ** (dim / (dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    elif kind == "yarn":
        scaling = {"original_max_position_embeddings": config.max_position_embeddings, **scaling}
        inv_freq, attention_factor = _yarn_inv_freq(inv_freq, dim, base, scaling)
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of x [B, H, T, D] (rotate-half convention)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


# ---------------------------------------------------------------- attention

def causal_mask(start: int, length: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Boolean mask [length, start+length]: query i (at position start+i) sees keys j <= start+i."""
    q_pos = torch.arange(start, start + length, device=device).unsqueeze(1)
    k_pos = torch.arange(start + length, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


# cuDNN's attention builds a graph for each new shape, and a decoding cache has a new length at
# every step: on an H200, bfloat16 verification passes at lengths not seen before took three
# times as long as at lengths seen (benchmarks/NOTES.md, "On an H200"). The other backends
# build nothing per shape.
_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The scaled_dot_product_attention backends verispec lets run on `device`."""
    return sdpa_kernel(_WITHOUT_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


# The longest verification pass: γ + 1 positions, γ <= 32 (generate.MAX_GAMMA). Passes up to
# this long compute each position exactly as a single decoding step would.
VERIFY_PASS_MAX = 33


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
           window: int | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, T, D], at positions start..start+T-1, over the cached keys
    and values [B, H_kv, start+T, D] (and only the last `window` of them, if set).

    On the CPU a pass of a few positions attends one position at a time, each exactly as a
    decoding step at that position would: PyTorch's CPU attention rounds a masked pass over
    several queries differently from a single query, and a verification pass must give each
    position the logits a plain step gives it, bit for bit.
    """
    if keys.dtype != q.dtype:  # a cache kept in a narrower type than the activations
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    length = q.shape[2]
    if q.device.type == "cpu" and 1 < length <= VERIFY_PASS_MAX:
        return torch.cat([attend(q[:, :, i:i + 1], keys[:, :, :start + i + 1], values[:, :, :start + i + 1],
                                 start + i, window) for i in range(length)], dim=2)
    end = start + length
    if length == 1 and (window is None or end <= window):
        mask = None  # a single query sees every cached key
    else:
        mask = causal_mask(start, length, q.device, window)
    with attention_backends(q.device):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=keys.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Grouped-query attention with optional QKV bias, q/k norm and a sliding window."""

    # projections a weight format may fuse into one product (verispec.quant)
    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        window = config.extra.get("sliding_window")
        uses_window = config.extra.get("use_sliding_window", config.model_type == "mistral")
        self.window = int(window) if window and uses_window else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, start: int) -> torch.Tensor:
        batch, length, _ = x.shape
        kernels = self._kernels(x, cos, cache)
        if kernels is not None:
            return self._kernel_forward(kernels, x, cos, sin, cache, start)
        if hasattr(self, "qkv_proj"):
            kv_width = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, length, self.num_heads, self.head_dim)
        k = k.view(batch, length, self.num_kv_heads, self.head_dim)
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(q, cos, sin).to(v.dtype)
        k = apply_rope(k, cos, sin).to(v.dtype)
        keys, values = cache.write(self.layer_index, start, k, v)
        out = attend(q, keys, values, start, self.window)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _kernels(self, x: torch.Tensor, cos: torch.Tensor, cache):
        """The CPU kernels, where their attention takes this pass (as the dense fast path has
        it: fused q/k/v, one sequence, a KVCache of a float type, full rotary); else None."""
        if x.device.type != "cpu" or x.shape[0] != 1 or x.shape[1] > KERNEL_MAX_ROWS:
            return None
        if not hasattr(self, "qkv_proj") or type(cache) is not KVCache or cache.k.dtype not in CACHE_DTYPES.values():
            return None
        if self.head_dim % 16 or cos.shape[-1] != self.head_dim or cache.k.shape[1] != 1:
            return None
        return cpu_kernels()

    def _kernel_forward(self, kernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache,
                        start: int) -> torch.Tensor:
        """Norms, rotary, cache write and attention in one kernel call, which reads each cached
        key once for every position of the pass and gives each position the bits of a step."""
        length = x.shape[1]
        qkv = self.qkv_proj(x).reshape(length, -1).float().contiguous()
        out = kernels.attention(qkv, cache.k[self.layer_index, 0], cache.v[self.layer_index, 0], cos.contiguous(),
                                sin.contiguous(), start, self.num_heads, self.num_kv_heads, self.window or 0,
                                *self.kernel_norms())
        return self.o_proj(out.view(1, length, -1).to(x.dtype))

    def kernel_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q norm weight, k norm weight, their eps) as the attention kernel takes them."""
        def weight(norm: RMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight.detach().float().contiguous()

        return weight(self.q_norm), weight(self.k_norm), self.q_norm.eps if self.q_norm is not None else 1e-6


class SwiGLU(nn.Module):
    FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def with_extra_rows(logits: torch.Tensor, hidden: torch.Tensor, extra_rows: torch.Tensor | None) -> torch.Tensor:
    """Float32 logits with the final hidden state's products with `extra_rows` appended."""
    if extra_rows is None:
        return logits
    return torch.cat([logits, hidden.float() @ extra_rows.float().T], dim=-1)
