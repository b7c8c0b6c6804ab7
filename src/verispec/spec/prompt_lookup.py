"""Prompt lookup: draft by copying what followed the last n-gram earlier in the text.

No draft model: the proposal is the continuation of the most recent earlier
occurrence of the context's last n tokens, trying the longest n first. Code
edits, summaries and retrieval answers repeat their input, so this is free
drafting that often hits.

A continuation runs no further ahead than its occurrence matches the context
going back: a match of one token drafts one token, a copy that has gone on for
twenty drafts all γ. A short match is weak evidence, and every drafted token
lengthens the target's pass; drafting the whole continuation whatever the match
made lookup at γ = 8 slower than plain decoding in most Spec-Bench categories on
processors where a long pass costs most (benchmarks/lookup_drafts.py).
`--adaptive` asks for the whole continuation: its policy weighs how much of it
to send from the acceptance it measures.
"""

from __future__ import annotations

import torch

from verispec.errors import VerispecError
from verispec.sampling import SamplingParams
from verispec.spec.proposer import Proposal


class PromptLookupProposer:
    """Keeps, for each n-gram size, where each n-gram last ended with a token after it, and
    extends that index by the tokens the context gained since the last round: a round costs
    the same at any context length, where scanning the context back for the last n tokens
    cost time in proportion to it (milliseconds per round at a few thousand tokens)."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, bounded_by_match: bool = True):
        if not 1 <= min_ngram <= max_ngram:
            raise VerispecError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.bounded_by_match = bounded_by_match
        self._forget()

    def _forget(self) -> None:
        # ends[n][gram] = the latest p with context[p - n:p] == gram and a token at p
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        self.length = 0  # tokens of the context the index covers
        self.marks: tuple[int, ...] = ()  # a few of them, to tell that a later context continues it

    def start(self, prompt_ids: list[int], max_len: int) -> None:
        self._forget()

    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        return Proposal(self.lookup(context, gamma))

    def lookup(self, context: list[int], gamma: int) -> list[int]:
        """The continuation of the most recent earlier occurrence of the context's last n
        tokens, for the largest n that has one; [] if none does. With `bounded_by_match`, it
        runs no further ahead than the occurrence matches the context going back."""
        self._extend(context)
        size = len(context)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            end = self.ends[n].get(tuple(context[size - n:]))
            if end is not None:
                if self.bounded_by_match:
                    gamma = min(gamma, matched_length(context, end, n, gamma))
                return context[end:end + gamma]
        return []

    def _extend(self, context: list[int]) -> None:
        """Index the n-grams that now have a token after them: those ending before the last token."""
        done = self.length
        if done > len(context) or self._marks(context, done) != self.marks:
            self._forget()  # another text than the one indexed
            done = 0
        for p in range(max(done, 1), len(context)):
            for n, ends in self.ends.items():
                if p >= n:
                    ends[tuple(context[p - n:p])] = p
        self.length, self.marks = len(context), self._marks(context, len(context))

    @staticmethod
    def _marks(context: list[int], length: int) -> tuple[int, ...]:
        return tuple(context[i] for i in sorted({0, length // 2, length - 1}) if 0 <= i < length)

    def commit(self, length: int) -> None:
        pass


def matched_length(context: list[int], end: int, n: int, limit: int) -> int:
    """How many tokens ending at `end` equal the context's last ones: at least `n`, which
    the lookup matched, counted on up to `limit`."""
    length, size = n, len(context)
    while length < limit and length < end and context[end - 1 - length] == context[size - 1 - length]:
        length += 1
    return length
