"""A lean forward pass for dense decoders on the CPU kernels.

The reference forward (models/dense.py) makes some 25 PyTorch calls per layer; on a
2-core CPU their dispatch costs as much as a small model's weights take to read. With
packed weights (verispec.quant) a layer here is seven calls: norm, fused q/k/v product,
attention (rotary, cache write and attention in one kernel), output product with the
residual added in, norm, fused gate/up product, SwiGLU, down product with the residual.

Activations stay float32 whatever the weight format. Every kernel is batch-invariant, so
a verification pass over γ+1 positions yields the very logits of γ+1 single steps.
The reference forward remains the path for everything this does not cover.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.cache import KVCache
from verispec.errors import ContextOverflowError
from verispec.kernels import cpu_kernels
from verispec.quant import KERNEL_MAX_ROWS, PackedLinear


class _Layer:
    """One decoder layer's tensors, as the kernels take them."""

    def __init__(self, layer: nn.Module, kernels):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm.weight.detach().float()
        self.norm2 = layer.post_attention_layernorm.weight.detach().float()
        self.eps1, self.eps2 = layer.input_layernorm.eps, layer.post_attention_layernorm.eps
        self.qkv, self.out = attn.qkv_proj.bound_kernel(kernels), attn.o_proj.bound_kernel(kernels)
        self.gate_up, self.down = mlp.gate_up_proj.bound_kernel(kernels), mlp.down_proj.bound_kernel(kernels)
        self.index, self.heads, self.kv_heads = attn.layer_index, attn.num_heads, attn.num_kv_heads
        self.window = attn.window or 0
        self.q_norm = attn.q_norm.weight.detach().float() if attn.q_norm is not None else None
        self.k_norm = attn.k_norm.weight.detach().float() if attn.k_norm is not None else None
        self.qk_eps = attn.q_norm.eps if attn.q_norm is not None else 1e-6


def _supported(model: nn.Module) -> bool:
    from verispec.models.common import Attention, SwiGLU
    from verispec.models.dense import CausalLM, DecoderLayer

    if type(model) is not CausalLM or not isinstance(model.lm_head, PackedLinear):
        return False
    for layer in model.model.layers:
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention:
            return False
        if type(layer.mlp) is not SwiGLU or not isinstance(getattr(layer.mlp, "gate_up_proj", None), PackedLinear):
            return False
        if not isinstance(getattr(layer.self_attn, "qkv_proj", None), PackedLinear):
            return False
    config = model.config
    return config.head_dim % 16 == 0 and config.hidden_size % 16 == 0 and config.hidden_act == "silu"


class FastPath:
    """`model.fast_path(tokens, cache, last_only)`: logits, or None when this path does not apply."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[_Layer] | None = None  # bound to the kernels on first use
        self.final_norm = model.model.norm.weight.detach().float()
        self.final_eps = model.model.norm.eps
        self.hidden = model.config.hidden_size

    def applies(self, tokens: torch.Tensor, cache) -> bool:
        return (tokens.device.type == "cpu" and tokens.shape[0] == 1 and type(cache) is KVCache
                and cache.k.shape[1] == 1 and cache.k.dtype == torch.float32 and cpu_kernels() is not None)

    def __call__(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor | None:
        """Logits [1, T, vocab] (or [1, 1, vocab] with last_only); None when this path does not apply.

        A long prompt goes through in slices of KERNEL_MAX_ROWS positions, so every position
        is computed by the same kernels as a decoding step."""
        if not self.applies(tokens, cache):
            return None
        slices = [tokens[:, i:i + KERNEL_MAX_ROWS] for i in range(0, tokens.shape[1], KERNEL_MAX_ROWS)]
        outputs = []
        for index, piece in enumerate(slices):
            final = index == len(slices) - 1
            logits = self._forward(piece, cache, last_only, head=final or not last_only)
            if logits is not None:
                outputs.append(logits)
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def _forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool, head: bool = True
                 ) -> torch.Tensor | None:
        kernels = cpu_kernels()
        if self.layers is None:
            self.layers = [_Layer(layer, kernels) for layer in self.model.model.layers]
            self.head = self.model.lm_head.bound_kernel(kernels)
        model, start, length = self.model, cache.length, tokens.shape[1]
        if start + length > cache.max_len:
            raise ContextOverflowError(
                f"sequence of {start + length} tokens exceeds the cache of {cache.max_len} positions")
        cos = model.rope_cos[start:start + length]
        sin = model.rope_sin[start:start + length]
        x = model.model.embed_tokens(tokens[0]).float()
        for layer in self.layers:
            h = kernels.rms_norm(x, layer.norm1, layer.eps1)
            qkv = layer.qkv(h)
            attended = kernels.attention(qkv, cache.k[layer.index, 0], cache.v[layer.index, 0], cos, sin,
                                         start, layer.heads, layer.kv_heads, layer.window,
                                         layer.q_norm, layer.k_norm, layer.qk_eps)
            x = layer.out(attended, x)
            h = kernels.rms_norm(x, layer.norm2, layer.eps2)
            x = layer.down(kernels.silu_mul(layer.gate_up(h)), x)
        cache.advance(length)
        if not head:
            return None
        if last_only:
            x = x[-1:]
        x = kernels.rms_norm(x.contiguous(), self.final_norm, self.final_eps)
        return self.head(x).unsqueeze(0)


def attach_fast_path(model: nn.Module) -> bool:
    """Give a dense CausalLM with packed, fused weights the lean forward; True if it got one."""
    model.fast_path = FastPath(model) if _supported(model) else None
    return model.fast_path is not None
