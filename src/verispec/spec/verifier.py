"""Deciding which drafted tokens the target keeps.

Given the target's logits over [last token, d1..dγ] (γ+1 rows; row i predicts
the token after d_i), keep drafts while the target agrees, then emit one token
of the target's own: the *recovered* token at the first rejection, or the
*bonus* token when all γ were kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling import SamplingParams, greedy_tokens, probabilities, sample


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


def verify_sampling(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                    params: SamplingParams, generator: torch.Generator) -> Verdict:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Keep draft d with probability min(1, p(d) / q(d)); at the first rejection
    draw from the residual max(0, p - q) renormalised. A draft without
    probabilities is one-hot: q(d) = 1. The emitted tokens then follow p exactly.
    """
    # draws use the request's CPU generator, so the rows they read move to the CPU once
    p = probabilities(target_logits, params).cpu()  # [γ+1, V]
    if draft_probs is not None:
        draft_probs = draft_probs.cpu()
    vocab = p.shape[-1]
    for i, draft in enumerate(drafts):
        p_row = p[i]
        if draft_probs is None:
            q_row = torch.zeros(vocab)
            if draft < vocab:
                q_row[draft] = 1.0
        else:
            q_row = on_target_vocab(draft_probs[i], vocab)
        p_d = float(p_row[draft]) if draft < vocab else 0.0
        q_d = float(draft_probs[i][draft]) if draft_probs is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            continue
        residual = (p_row - q_row).clamp(min=0)  # sample() normalises it
        if float(residual.sum()) <= 0:  # p == q on the target's vocabulary: any rejection is measure-zero
            residual = p_row
        token = sample(residual, generator)
        return Verdict(i, token, bonus=False)
    token = sample(p[len(drafts)], generator)
    return Verdict(len(drafts), token, bonus=True)


def on_target_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft distributions (over the last dimension) on the target's vocabulary (padding rows
    differ in size): cut, or padded with zeros."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
