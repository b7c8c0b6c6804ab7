"""The interface every drafting method implements."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from verispec.sampling import SamplingParams


@dataclass
class DraftProbs:
    """A draft's distribution at each drafted token, after the same warping as the target's:
    rows [tokens, columns] over its own columns, which are ids 0, 1, ... and then `extra_ids`
    (a draft limited to the first ids proposes the context's too). The verifier reads one
    probability per draft and a whole row, on the target's vocabulary, only at a rejection."""
    rows: torch.Tensor
    extra_ids: Sequence[int] = ()

    @property
    def first(self) -> int:
        """How many leading columns are ids 0, 1, ..."""
        return self.rows.shape[-1] - len(self.extra_ids)

    @functools.cached_property
    def _extra_columns(self) -> dict[int, int]:
        return {token: self.first + i for i, token in enumerate(self.extra_ids)}

    def of(self, row: int, token: int) -> float:
        """The probability the draft gave `token` at drafted position `row`."""
        column = token if token < self.first else self._extra_columns.get(token)
        return 0.0 if column is None else float(self.rows[row, column])

    def take_from(self, row: int, p: torch.Tensor) -> torch.Tensor:
        """max(0, p - q) for this draft's q at `row`, written over p (a CPU float32 row of the
        target's vocabulary): the residual a rejection draws from. Through NumPy, on this
        thread: torch would wake its second thread for each pass over the row."""
        out, q = p.numpy(), self.rows[row].cpu().float().numpy()
        first = min(self.first, out.size)
        out[:first] -= q[:first]
        extra = np.asarray(self.extra_ids, dtype=np.int64)
        inside = extra < out.size
        out[extra[inside]] -= q[self.first:][inside]
        np.maximum(out, 0, out=out)
        return p


@dataclass
class Proposal:
    tokens: list[int]
    # the draft's distributions; None means a one-hot draft (a proposer that has no
    # distribution, such as n-gram lookup)
    probs: DraftProbs | None = None
    # the draft steps (forward passes) it took, where not one per token: a draft model's first
    # token may come from the pass that read the context before it
    steps: int | None = None


class Proposer(Protocol):
    name: str

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        """A new request begins with this prompt; max_len bounds prompt + output + drafts."""

    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        """Up to gamma tokens to follow context (prompt + every committed token)."""

    def commit(self, length: int) -> None:
        """The first `length` tokens of the last context + proposal are final; forget the rest."""
