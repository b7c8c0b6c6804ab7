"""Dense decoders of the Llama kind: Llama, Mistral, Qwen2, Qwen3 (and SmolLM, which is Llama).

pre-norm blocks: x + attn(norm(x)), then x + swiglu(norm(x)); rotary positions;
grouped-query attention; optional QKV bias (Qwen2), q/k norm (Qwen3), tied embeddings.
Parameter names follow the Hugging Face checkpoints, so their state dicts load as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.cache import KVCache
from verispec.config import ModelConfig
from verispec.errors import ContextOverflowError
from verispec.models.common import Attention, RMSNorm, SwiGLU, rope_tables, with_extra_rows


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only language model over a position-indexed KV cache.

    `forward(tokens, cache)` runs the tokens at positions cache.length.. and
    returns float32 logits; with `last_only` only the final position's row, with
    `outputs` only the first `outputs` token ids' (a draft that proposes no others
    skips the rest of the output layer), and with `extra_rows` [E, hidden] E more
    columns after them, the final hidden state's products with those rows (the
    output layer's rows of a few more ids, which a draft limited to the first ids
    may propose too).
    """

    def __init__(self, config: ModelConfig, layers: list[nn.Module] | None = None):
        super().__init__()
        self.config = config
        if layers is None:
            layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.model = Backbone(config, layers)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        # rotary tables are plain attributes, built for the longest cache asked for so far
        self._rope_len = 0
        self.rope_cos = self.rope_sin = None
        self.fast_path = None  # verispec.fast attaches a lean forward for packed weights
        # the type of the keys and values a new cache keeps (None: the activations' type);
        # load_model's kv_cache sets it
        self.cache_dtype: torch.dtype | None = None

    def table(self) -> torch.Tensor:
        """The tensor the embedding table lives in, for its type and device (a tied float
        output layer may hold it in panels, which are not to be rebuilt for that)."""
        embedding = self.model.embed_tokens
        return embedding.weight if isinstance(embedding, nn.Embedding) else embedding.stored

    # -- cache
    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        self.ensure_rope(max_len)
        c = self.config
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_len,
                       batch, self.kv_dtype(), self.table().device)

    def kv_dtype(self) -> torch.dtype:
        """The type a new cache keeps keys and values in: cache_dtype, else the activations' type."""
        if self.cache_dtype is not None:
            return self.cache_dtype
        if self.fast_path is not None:
            return torch.float32  # the fast path computes in float32 whatever the weight format
        ref = self.table()
        # a table kept in packed blocks (quant.GgufEmbedding) says what type its rows come in
        return ref.dtype if ref.dtype.is_floating_point else getattr(self.model.embed_tokens, "dtype", torch.float32)

    def ensure_rope(self, max_len: int) -> None:
        device = self.table().device
        if max_len > self._rope_len or self.rope_cos.device != device:
            cos, sin = rope_tables(self.config, max_len)
            self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
            self._rope_len = max_len

    def output_weight(self) -> nn.Module:
        return self.lm_head if self.lm_head is not None else self.model.embed_tokens

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the output layer, read from whatever form it is kept in: a
        packed layer's panels, a linear layer's weight, or the embedding table it shares."""
        layer = self.output_weight()
        if hasattr(layer, "rows"):
            return layer.rows(ids).float()
        if isinstance(layer, nn.Linear):
            return layer.weight[ids].float()
        return layer(ids).float()

    # -- forward
    def forward(self, tokens: torch.Tensor, cache, last_only: bool = False,
                outputs: int | None = None, extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.fast_path is not None:
            logits = self.fast_path(tokens, cache, last_only, outputs, extra_rows)
            if logits is not None:
                return logits
        start = cache.length
        length = tokens.shape[1]
        if start + length > cache.max_len:
            raise ContextOverflowError(
                f"{start + length} positions do not fit the cache of {cache.max_len}")
        cos = self.rope_cos[start:start + length]
        sin = self.rope_sin[start:start + length]
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, start)
        cache.advance(length)
        if last_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        if self.lm_head is not None:
            logits = self.lm_head(x)
        else:
            logits = torch.nn.functional.linear(x, self.model.embed_tokens.weight)
        return with_extra_rows(logits[..., :outputs].float(), x, extra_rows)
