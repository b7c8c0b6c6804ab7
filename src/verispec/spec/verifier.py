"""Deciding which drafted tokens the target keeps.

Given the target's logits over [last token, d1..dγ] (γ+1 rows; row i predicts
the token after d_i), keep drafts while the target agrees, then emit one token
of the target's own: the *recovered* token at the first rejection, or the
*bonus* token when all γ were kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.sampling import SamplingParams, greedy_tokens, probabilities, sample
from verispec.spec.proposer import DraftProbs

if TYPE_CHECKING:
    from verispec.penalties import RowsAsRead


@dataclass
class Verdict:
    accepted: int  # how many drafted tokens are kept
    token: int  # the target's own token after them
    bonus: bool  # True when every draft was kept

    def tokens(self, drafts: list[int]) -> list[int]:
        return [*drafts[:self.accepted], self.token]


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """Keep drafts while each equals the target's argmax."""
    choices = greedy_tokens(target_logits)
    for i, draft in enumerate(drafts):
        if choices[i] != draft:
            return Verdict(i, choices[i], bonus=False)
    return Verdict(len(drafts), choices[len(drafts)], bonus=True)


def verify_sampling(target_logits: torch.Tensor | RowsAsRead, drafts: list[int], draft_probs: DraftProbs | None,
                    params: SamplingParams, generator: torch.Generator) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Keep draft d with probability min(1, p(d) / q(d)); at the first rejection
    draw from the residual max(0, p - q) renormalised. A draft without
    probabilities is one-hot: q(d) = 1. The emitted tokens then follow p exactly.
    The target's distribution is computed row by row as the drafts are looked at: the rows
    after a rejection are never needed, and each is a pass over the vocabulary. So
    `target_logits` is indexed by row alone, and may be rows ruled as they are read
    (verispec.penalties.RowsAsRead).
    """
    for i, draft in enumerate(drafts):
        # draws use the request's CPU generator, so the rows they read move to the CPU
        p_row = probabilities(target_logits[i], params).cpu()
        vocab = p_row.shape[-1]
        p_d = float(p_row[draft]) if draft < vocab else 0.0
        q_d = draft_probs.of(i, draft) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            continue
        # the residual max(0, p - q), over p's row; sample() normalises it
        if draft_probs is None:
            residual = p_row
            if draft < vocab:
                residual[draft] = 0.0  # max(0, p(d) - 1)
        else:
            residual = draft_probs.take_from(i, p_row.float())
        if not residual.numpy().any():  # p == q on the target's vocabulary: any rejection is measure-zero
            residual = probabilities(target_logits[i], params).cpu()
        return Verdict(i, sample(residual, generator), bonus=False)
    token = sample(probabilities(target_logits[len(drafts)], params).cpu(), generator)
    return Verdict(len(drafts), token, bonus=True)


def on_target_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft distributions (over the last dimension) on the target's vocabulary (padding rows
    differ in size): cut, or padded with zeros."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
