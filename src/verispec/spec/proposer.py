"""The interface every drafting method implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: list[int]
    # the draft's probabilities [len(tokens), vocab] after the same warping as the target;
    # None means a one-hot draft (a proposer that has no distribution, such as n-gram lookup)
    probs: torch.Tensor | None = None
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
