"""Synthetic acceptance, for system studies: draft the target's own token with probability α.

It needs the target's greedy output in advance (`reference`), so it measures the
cost of speculation at a chosen acceptance rate; it can never serve requests.
"""

from __future__ import annotations

import random

import torch

from verispec.sampling import SamplingParams
from verispec.spec.proposer import Proposal


class SyntheticProposer:
    def __init__(self, reference: list[int], alpha: float, vocab_size: int, seed: int = 0):
        self.reference = reference
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.name = f"synthetic(α={alpha:g})"
        self.prompt_len = 0

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        done = len(context) - self.prompt_len
        tokens = []
        for i in range(gamma):
            index = done + i
            right = self.reference[index] if index < len(self.reference) else 0
            if self.rng.random() < self.alpha:
                tokens.append(right)
            else:
                tokens.append((right + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size)
        return Proposal(tokens)

    def commit(self, length: int) -> None:
        pass
