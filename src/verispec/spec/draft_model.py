"""A smaller language model drafts tokens autoregressively over its own cache."""

from __future__ import annotations

import torch

from verispec.sampling import SamplingParams, probabilities
from verispec.spec.proposer import Proposal


class DraftModelProposer:
    """Drafts γ tokens one step at a time.

    The draft cache holds every token it has been fed. A round feeds only what
    the cache lacks: normally the target's last token, or after a fully kept
    round the last draft plus the bonus token together, in one pass rather
    than an extra one. The γ-th draft is never fed: if it is kept, it is fed
    together with the next round's first token.
    """

    def __init__(self, loaded, name: str | None = None, vocab_limit: int | None = None):
        self.loaded = loaded
        # never draft a padding row the target has no embedding for
        self.vocab_limit = min(vocab_limit or loaded.config.vocab_size, loaded.config.vocab_size)
        self.model = loaded.model
        self.name = name or loaded.name
        self.cache = None
        self.device = loaded.device

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], max_len: int, prefill: bool = True) -> None:
        """Prefill the prompt, so that the first round pays only for drafting. Without
        `prefill` the draft reads the prompt later: through `catch_up`, or in its first round."""
        self.cache = self.model.new_cache(max_len)
        if prefill:
            self.model(torch.tensor([prompt_ids], device=self.device), self.cache, last_only=True)

    def lag(self, context: list[int]) -> int:
        """How many tokens of the context the draft has not read yet."""
        return len(context) - self.cache.length

    @torch.inference_mode()
    def catch_up(self, context: list[int], tokens: int) -> None:
        """Read up to `tokens` more tokens of the context (never its last, which `propose` feeds)."""
        end = min(len(context) - 1, self.cache.length + tokens)
        if end > self.cache.length:
            feed = torch.tensor([context[self.cache.length:end]], device=self.device)
            self.model(feed, self.cache, last_only=True)

    @torch.inference_mode()
    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        pending = context[self.cache.length:]
        feed = torch.tensor([pending], device=self.device)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(gamma):
            logits = self.model(feed, self.cache, last_only=True)[0, -1, :self.vocab_limit]
            if params.greedy:
                token = int(logits.argmax())
            else:
                probs = probabilities(logits, params)
                token = int(torch.multinomial(probs, 1, generator=generator))
                rows.append(probs)
            tokens.append(token)
            if i + 1 < gamma:
                feed = torch.tensor([[token]], device=self.device)
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def commit(self, length: int) -> None:
        if self.cache.length > length:
            self.cache.rollback(length)
