"""State of hybrid decoders (Qwen3.5, Qwen3-Next), with rollback that is exact.

Attention layers keep keys and values in a position-indexed KVCache, rolled back
for free. Every gated delta-net layer keeps two small states that summarise the
whole past instead:

    conv window     the last K-1 inputs of its causal depthwise convolution, [B, C, K-1]
    recurrent state S, one [Dk, Dv] matrix per value head, [B, Hv, Dk, Dv], float32

and a state cannot be "moved back": once token t is folded into S, S no longer
says what it was before. So rollback is checkpoint + replay:

    base     the states at the last commit point (the last rollback, or the start);
    records  for every position fed since, what the delta rule consumed there: the
             convolution input, the normalised key, the value, the decay and beta
             (C + Hk*Dk + Hv*Dv + 2*Hv numbers per position and layer, no states);
    rollback(n) rebuilds the conv window from the base window and the kept inputs
             (a copy), and replays the delta rule from the base state over the kept
             positions with the chunked form (one small batched pass per layer, no
             weights read), then makes n the new commit point.

Costs. Memory: the base and the live state (2x the state), plus the records of at
most 2 * replay_window positions. Time per rollback: one delta-rule pass over the
kept positions, about the work the verify pass itself spent on the state; rolling
back to the current length (everything kept) or to the commit point costs nothing.
The alternative, keeping the state after every position of a pass, costs no replay
but writes T full states per pass of T positions (T x 2 MiB per layer for a
Qwen3.5-9B layer, 32 heads of 128 x 128) against one. benchmarks/hybrid_rollback.py
measures the rollback against a step and a verify pass.

What cannot be rolled back is refused with RollbackError: positions before the last
commit point, and positions inside a pass longer than `replay_window` tokens (a long
prompt keeps no records; its start and end can still be returned to). The engine
only ever rolls back inside its last verify pass or the draft's steps since the
last commit, which the window always covers. Rolling back to 0 always works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.cache import KVCache
from verispec.errors import ContextOverflowError, RollbackError
from verispec.models.common import VERIFY_PASS_MAX

REPLAY_WINDOW = 64  # positions of history always kept: 2x the engine's longest draft


# ---------------------------------------------------------------- the gated delta rule

def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One position, the recurrent form. q, k [B, H, Dk]; v [B, H, Dv]; decay (log space), beta [B, H];
    state [B, H, Dk, Dv]. Returns (output [B, H, Dv] or None without q, new state)."""
    state = state * decay.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q) if q is not None else None
    return out, state


def delta_rule_chunked(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk_size: int = 64
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """T positions at once. q, k [B, H, T, Dk]; v [B, H, T, Dv]; decay, beta [B, H, T].

    Inside a chunk the T sequential rank-one updates are condensed into matrix
    products (the WY / UT form of DeltaNet, Yang et al. 2024): solving one unit
    lower-triangular system gives every position's corrected value at once; the
    chunks are then chained through the state. Returns (output [B, H, T, Dv] or
    None without q, state after the last position).
    """
    length = k.shape[2]
    size = min(chunk_size, length)
    pad = (-length) % size
    if pad:  # padded positions have beta = 0 and no decay: they leave the state as it is
        k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (k, v))
        q = torch.nn.functional.pad(q, (0, 0, 0, pad)) if q is not None else None
        decay, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (decay, beta))
    batch, heads = k.shape[:2]
    chunks = k.shape[2] // size

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, chunks, size, *x.shape[3:])

    k, v, decay, beta = split(k), split(v), split(decay), split(beta)
    cum = decay.cumsum(dim=-1)  # log of the decay from the chunk start to each position
    index = torch.arange(size, device=k.device)
    above = index[:, None] < index[None, :]
    # pair[i, j] = decay from position j to i (i >= j), 0 above the diagonal
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower-triangular once the diagonal is read as 1
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    carry_keys = k * (cum[..., -1:] - cum).exp()[..., None]  # each key decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]
    if q is not None:
        q = split(q)
        inner = (q @ k.transpose(-1, -2)) * pair
        q_decayed = q * cum.exp()[..., None]
        out = torch.empty_like(v)
    for c in range(chunks):
        corrected = values[:, :, c] - state_keys[:, :, c] @ state  # what the old state fails to predict
        if q is not None:
            out[:, :, c] = q_decayed[:, :, c] @ state + inner[:, :, c] @ corrected
        state = state * chunk_decay[:, :, c] + carry_keys[:, :, c].transpose(-1, -2) @ corrected
    if q is None:
        return None, state
    return out.reshape(batch, heads, -1, out.shape[-1])[:, :, :length], state


def delta_rule(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The recurrent form position by position for a pass no longer than a verification pass,
    the chunked form for longer ones (prompts); [B, H, T, ...] layout.

    The chunked form is the same function rounded differently, and a verification pass, or
    the replay of its kept positions, must leave the outputs and the state that plain steps
    leave, bit for bit: so up to VERIFY_PASS_MAX positions the pass is those steps.
    """
    length = k.shape[2]
    if length > VERIFY_PASS_MAX:
        return delta_rule_chunked(q, k, v, decay, beta, state)
    def at(x: torch.Tensor, t: int) -> torch.Tensor:  # one position, laid out as a step's own
        return x[:, :, t].contiguous()

    outputs = []
    for t in range(length):
        out, state = delta_rule_step(None if q is None else at(q, t), at(k, t), at(v, t), at(decay, t),
                                     at(beta, t), state)
        outputs.append(out)
    return (None if q is None else torch.stack(outputs, dim=2)), state


# ---------------------------------------------------------------- the cache

@dataclass(frozen=True)
class DeltaNetShape:
    """Sizes of a gated delta-net layer, from the config's linear_* keys."""

    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int

    @property
    def conv_channels(self) -> int:  # q, k and v all pass through the convolution
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_bytes(self, conv_element_bytes: int, batch: int = 1) -> int:
        """One layer's conv window plus its float32 recurrent state."""
        conv = self.conv_channels * (self.conv_kernel - 1) * conv_element_bytes
        recurrent = self.value_heads * self.key_dim * self.value_dim * 4
        return batch * (conv + recurrent)


@dataclass
class PassRecord:
    """What one pass fed a delta-net layer: enough to replay its state, position by position."""

    conv_inputs: torch.Tensor  # [B, C, T]
    keys: torch.Tensor  # [B, Hk, T, Dk], l2-normalised
    values: torch.Tensor  # [B, Hv, T, Dv]
    decay: torch.Tensor  # [B, Hv, T], log space
    beta: torch.Tensor  # [B, Hv, T]

    @property
    def length(self) -> int:
        return self.values.shape[2]

    @staticmethod
    def join(records: list["PassRecord"]) -> "PassRecord":
        if len(records) == 1:
            return records[0]
        return PassRecord(torch.cat([r.conv_inputs for r in records], dim=2),
                          *(torch.cat([getattr(r, f) for r in records], dim=2)
                            for f in ("keys", "values", "decay", "beta")))

    def slice(self, begin: int, end: int | None = None) -> "PassRecord":
        return PassRecord(self.conv_inputs[:, :, begin:end], self.keys[:, :, begin:end],
                          self.values[:, :, begin:end], self.decay[:, :, begin:end], self.beta[:, :, begin:end])


class HybridCache:
    """KV cache for the attention layers and rollback-exact delta-net states; see the module notes.

    The engine's interface: `length`, `max_len`, `write(layer, start, k, v)` where
    `layer` counts attention layers only, `advance(n)`, `rollback(length)`. A model
    calls `begin_pass(n)` before each pass; delta-net layers read `linear_state(i)`
    and store their new state with `update_linear(i, ...)`.
    """

    trimmable = True

    def __init__(self, attention_layers: int, kv_heads: int, head_dim: int, linear_layers: int,
                 shape: DeltaNetShape, max_len: int, batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", replay_window: int = REPLAY_WINDOW,
                 kv_dtype: torch.dtype | None = None):
        # the attention layers' keys and values may be kept in another type than the states
        self.kv = KVCache(attention_layers, kv_heads, head_dim, max_len, batch, kv_dtype or dtype, device)
        self.shape = shape
        self.max_len = max_len
        self.length = 0
        self.replay_window = replay_window
        self._batch, self._dtype, self._device = batch, dtype, device
        self._linear_layers = linear_layers
        self.conv, self.recurrent = self._zero_states()
        self._commit()

    # -- what the layers use
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write(layer, start, k, v)

    def linear_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv window, recurrent state) of delta-net layer `layer`, after every fed position."""
        return self.conv[layer], self.recurrent[layer]

    def update_linear(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, record: PassRecord) -> None:
        """New states after this pass; the layer must build new tensors, never write into the old ones."""
        self.conv[layer], self.recurrent[layer] = conv, recurrent
        if self._recording:
            self.records[layer].append(record)

    def begin_pass(self, length: int) -> None:
        """Called before a pass over `length` new positions: bounds the records it keeps."""
        end = self.length + length
        if end > self.max_len:
            raise ContextOverflowError(f"{end} positions do not fit the cache of {self.max_len}")
        if not self._recording or length > self.replay_window:
            self._commit()  # nothing to replay from: the current state becomes the base
        if length > self.replay_window:
            self._recording = False  # a long pass (a prompt) keeps no per-position records
        elif end - self.base_length > 2 * self.replay_window:
            self._move_base(end - self.replay_window)

    def advance(self, n: int) -> None:
        self.kv.advance(n)
        self.length += n

    # -- rollback
    def rollback(self, length: int) -> None:
        """Forget every position at or after `length`; the states become those after `length` tokens."""
        if not 0 <= length <= self.length:
            raise RollbackError(f"cannot roll back a cache of length {self.length} to {length}")
        if length == self.length:
            pass
        elif length == 0:
            self.conv, self.recurrent = self._zero_states()
        elif length == self.base_length:
            self.conv, self.recurrent = list(self.base_conv), list(self.base_recurrent)
        elif length > self.base_length and self._recording:
            self.conv, self.recurrent = self._replay(length - self.base_length)
        elif length < self.base_length:
            raise RollbackError(
                f"cannot roll back the recurrent state to position {length}: it is kept only from "
                f"position {self.base_length} on (the last commit point), and rebuilding it from an "
                f"earlier position would mean running the model over the tokens again")
        else:
            raise RollbackError(
                f"cannot roll back the recurrent state to position {length}: it lies inside the last "
                f"pass of {self.length - self.base_length} tokens, and passes longer than "
                f"{self.replay_window} tokens keep no per-position record (positions {self.base_length} "
                f"and {self.length} can be returned to)")
        self.kv.rollback(length)
        self.length = length
        self._commit()

    # -- sizes
    def state_bytes(self) -> int:
        """Bytes of delta-net state every pass reads (and writes back): conv windows and recurrent states."""
        return sum(c.numel() * c.element_size() + r.numel() * r.element_size()
                   for c, r in zip(self.conv, self.recurrent))

    def nbytes(self) -> int:
        """Memory held: the KV buffers, the live and the base states (records excluded)."""
        return self.kv.nbytes() + 2 * self.state_bytes()

    def linear_states(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(conv window, recurrent state) of every delta-net layer, in layer order."""
        return list(zip(self.conv, self.recurrent))

    # -- internals
    def _zero_states(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        s, b = self.shape, self._batch
        conv = [torch.zeros(b, s.conv_channels, s.conv_kernel - 1, dtype=self._dtype, device=self._device)
                for _ in range(self._linear_layers)]
        recurrent = [torch.zeros(b, s.value_heads, s.key_dim, s.value_dim, dtype=torch.float32,
                                 device=self._device) for _ in range(self._linear_layers)]
        return conv, recurrent

    def _commit(self) -> None:
        """The current states become the base: nothing before this point can be returned to."""
        self.base_conv, self.base_recurrent = list(self.conv), list(self.recurrent)
        self.base_length = self.length
        self.records: list[list[PassRecord]] = [[] for _ in range(self._linear_layers)]
        self._recording = True

    def _replay(self, kept: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """States after the first `kept` recorded positions past the base."""
        convs, states = [], []
        window = self.shape.conv_kernel - 1
        for layer in range(self._linear_layers):
            record = PassRecord.join(self.records[layer]).slice(0, kept)
            inputs = torch.cat([self.base_conv[layer], record.conv_inputs], dim=2)
            convs.append(inputs[:, :, inputs.shape[2] - window:])
            repeat = self.shape.value_heads // self.shape.key_heads
            keys = record.keys.repeat_interleave(repeat, dim=1) if repeat > 1 else record.keys
            _, state = delta_rule(None, keys, record.values, record.decay, record.beta,
                                  self.base_recurrent[layer])
            states.append(state)
        return convs, states

    def _move_base(self, position: int) -> None:
        """Advance the base to `position` by replay and drop the records before it."""
        kept = position - self.base_length
        self.base_conv, self.base_recurrent = self._replay(kept)
        self.records = [[PassRecord.join(records).slice(kept)] for records in self.records]
        self.base_length = position
