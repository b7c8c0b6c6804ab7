"""A lean forward pass for dense decoders on the CPU kernels.

The reference forward (models/dense.py) makes some 25 PyTorch calls per layer; on a
2-core CPU their dispatch costs as much as a small model's weights take to read. With
packed weights (verispec.quant) a layer is eight kernel calls: norm, fused q/k/v product,
attention (rotary, cache write and attention in one kernel), output product with the
residual added in, norm, fused gate/up product, SwiGLU, down product with the residual;
the kernels' DecoderStack makes them for every layer in one call from Python.

Activations stay float32 whatever the weight format. Every kernel is batch-invariant, so
a verification pass over γ+1 positions yields the very logits of γ+1 single steps.
The reference forward remains the path for everything this does not cover.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.cache import CACHE_DTYPES, KVCache
from verispec.errors import ContextOverflowError
from verispec.kernels import cpu_kernels
from verispec.models.common import with_extra_rows
from verispec.quant import KERNEL_MAX_ROWS, PANEL, PackedLinear


def _decoder_layer(layer: nn.Module, kernels):
    """One decoder layer's tensors and bound products, as the kernels' DecoderStack takes them."""
    attn, mlp = layer.self_attn, layer.mlp

    def norm(module: nn.Module) -> torch.Tensor:
        return module.weight.detach().float().contiguous()

    q_norm, k_norm, qk_eps = attn.kernel_norms()
    return kernels.DecoderLayer(
        norm1=norm(layer.input_layernorm), eps1=layer.input_layernorm.eps,
        qkv=attn.qkv_proj.bound_kernel(kernels), out=attn.o_proj.bound_kernel(kernels),
        norm2=norm(layer.post_attention_layernorm), eps2=layer.post_attention_layernorm.eps,
        gate_up=mlp.gate_up_proj.bound_kernel(kernels), down=mlp.down_proj.bound_kernel(kernels),
        index=attn.layer_index, heads=attn.num_heads, kv_heads=attn.num_kv_heads, window=attn.window or 0,
        q_norm=q_norm, k_norm=k_norm, qk_eps=qk_eps)


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

    def __init__(self, model: nn.Module, kernels=None):
        self.model = model
        self.kernels = kernels  # a compiled kernel module; None: the engine's own (cpu_kernels)
        self.stack = self.final_norm = None  # bound to the model's tensors on first use
        self.heads: dict[int | None, object] = {}  # the output layer, whole (None) or its first rows
        self.final_eps = model.model.norm.eps
        self.hidden = model.config.hidden_size

    def applies(self, tokens: torch.Tensor, cache) -> bool:
        return (tokens.device.type == "cpu" and tokens.shape[0] == 1 and type(cache) is KVCache
                and cache.k.shape[1] == 1 and cache.k.dtype in CACHE_DTYPES.values() and self._kernels() is not None)

    def _kernels(self):
        """The kernel module this path runs on: its own, or the engine's (None if not built)."""
        return self.kernels or cpu_kernels()

    def __call__(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False,
                 outputs: int | None = None, extra_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [1, T, vocab] (or [1, 1, vocab] with last_only; the first `outputs` ids only
        with `outputs`, then the products with `extra_rows`, as CausalLM.forward); None when
        this path does not apply.

        A long prompt goes through in slices of KERNEL_MAX_ROWS positions, so every position
        is computed by the same kernels as a decoding step."""
        if not self.applies(tokens, cache):
            return None
        slices = [tokens[:, i:i + KERNEL_MAX_ROWS] for i in range(0, tokens.shape[1], KERNEL_MAX_ROWS)]
        pieces = []
        for index, piece in enumerate(slices):
            final = index == len(slices) - 1
            logits = self._forward(piece, cache, last_only, head=final or not last_only, outputs=outputs,
                                   extra_rows=extra_rows)
            if logits is not None:
                pieces.append(logits)
        return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]

    def _forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool, head: bool = True,
                 outputs: int | None = None, extra_rows: torch.Tensor | None = None) -> torch.Tensor | None:
        kernels = self._kernels()
        if self.stack is None:
            self.stack = kernels.DecoderStack([_decoder_layer(layer, kernels) for layer in self.model.model.layers])
            self.final_norm = self.model.model.norm.weight.detach().float()
        model, start, length = self.model, cache.length, tokens.shape[1]
        if start + length > cache.max_len:
            raise ContextOverflowError(
                f"sequence of {start + length} tokens exceeds the cache of {cache.max_len} positions")
        cos = model.rope_cos[start:start + length]
        sin = model.rope_sin[start:start + length]
        x = model.model.embed_tokens(tokens[0]).float()
        x = self.stack.forward(x, cache.k, cache.v, cos, sin, start)
        cache.advance(length)
        if not head:
            return None
        if last_only:
            x = x[-1:]
        x = kernels.rms_norm(x.contiguous(), self.final_norm, self.final_eps)
        return with_extra_rows(self._head(kernels, outputs)(x)[..., :outputs], x, extra_rows).unsqueeze(0)

    def _head(self, kernels, outputs: int | None):
        """The output layer's product, for all its rows or the first `outputs` (rounded up to
        the panel layout's sixteens; the caller slices)."""
        rows = self.model.lm_head.out_features
        if outputs is not None:
            outputs = -(-outputs // PANEL) * PANEL
            if outputs >= rows:
                outputs = None
        if outputs not in self.heads:
            self.heads[outputs] = self.model.lm_head.bound_kernel(kernels, outputs)
        return self.heads[outputs]


def attach_fast_path(model: nn.Module) -> bool:
    """Give a dense CausalLM with packed, fused weights the lean forward; True if it got one."""
    model.fast_path = FastPath(model) if _supported(model) else None
    return model.fast_path is not None
