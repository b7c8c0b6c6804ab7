"""Key/value cache: preallocated, written at explicit positions, rolled back for free.

Position p of every layer lives in slot p. A forward pass over T tokens writes
slots [length, length+T) and attends to slots [0, length+T). Rolling back to an
earlier length only moves `length`: the slots past it are never read again and
are overwritten by the next pass, so a rejected draft costs no copy.
"""

from __future__ import annotations

import torch

from verispec.errors import ContextOverflowError, RollbackError

# The types a cache may keep its keys and values in (load_model's kv_cache, `--kv-cache`). The
# CPU attention kernel reads each of them, and rounds new keys and values to the cache's type
# as it writes them, before any position attends to them: a verification pass still gives
# each position the bits a single step gives it.
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVCache:
    trimmable = True

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, H, T, D] at positions start.. and return all keys/values up to the end."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ContextOverflowError(
                f"sequence of {end} tokens exceeds the cache of {self.max_len} positions")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def rollback(self, length: int) -> None:
        """Forget every position at or after `length`."""
        if not 0 <= length <= self.length:
            raise RollbackError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
