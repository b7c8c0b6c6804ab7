"""Prompt lookup: draft by copying what followed the last n-gram earlier in the text.

No draft model: the proposal is the continuation of the most recent earlier
occurrence of the context's last n tokens, trying the longest n first. Code
edits, summaries and retrieval answers repeat their input, so this is free
drafting that often hits.
"""

from __future__ import annotations

import torch

from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.spec.proposer import Proposal


class PromptLookupProposer:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise VerispecError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        pass

    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        return Proposal(self.lookup(context, gamma))

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        size = len(context)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = context[size - n:]
            # scan backwards for the most recent earlier occurrence that has a continuation
            for start in range(size - n - 1, -1, -1):
                if context[start:start + n] == suffix:
                    follow = context[start + n:start + n + gamma]
                    if follow:
                        return follow
        return []

    def commit(self, length: int) -> None:
        pass
