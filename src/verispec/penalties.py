"""Penalties on repeating: the target's logits adjusted by what the text holds so far.

As vLLM and OpenAI define them: `repetition` (CTRL's penalty) divides a positive logit by r
and multiplies a negative one by r, for every id in the prompt or the output; then
`frequency` subtracts f for each time an id was generated and `presence` subtracts p once
an id has been generated at all. Plain decoding with penalties is the penalised target's
output, and speculative decoding keeps it so: each row of a verification pass is penalised
by the output before its position, the drafts before it included. The draft proposes from
its own unpenalised logits; that costs acceptance, never exactness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from verispec.errors import VerispecError
from verispec.values import is_number

MAX_ADDITIVE = 2.0  # OpenAI's range for presence and frequency penalties: -2 to 2


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name, value in (("presence", self.presence), ("frequency", self.frequency)):
            if not is_number(value, -MAX_ADDITIVE, MAX_ADDITIVE):
                raise VerispecError(f"the {name} penalty must be a number from -2 to 2, got {value!r}")
        if not is_number(self.repetition) or self.repetition <= 0:
            raise VerispecError(f"the repetition penalty must be a number > 0 (1: none), got {self.repetition!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    def penalised(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`logits` of ids that appear in the context, each generated counts[i] times (0: only
        in the prompt); one function for whole rows and single entries, so both round alike."""
        if self.repetition != 1:
            logits = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        return logits - self.frequency * counts - self.presence * (counts > 0).float()


class PenaltyState:
    """One request's penalties and the ids its text holds: the prompt's (for the repetition
    penalty) and how often each was generated."""

    def __init__(self, penalties: Penalties, prompt_ids: Iterable[int]):
        self.penalties = penalties
        self.generated: Counter[int] = Counter()
        self.prompt = set(prompt_ids) if penalties.repetition != 1 else set()
        self._columns: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, tokens: Iterable[int]) -> None:
        """Tokens that joined the output."""
        self.generated.update(tokens)
        self._columns = None

    def apply(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Penalised copies of a pass's rows [rows, vocab]: row i follows the output and drafts[:i]."""
        out = logits.clone()
        ids, counts = self._context_columns(logits.device)
        if ids.numel():
            out[:, ids] = self.penalties.penalised(logits[:, ids], counts)
        vocab = logits.shape[-1]
        for row in range(1, logits.shape[0]):
            for token, extra in Counter(drafts[:row]).items():
                if token < vocab:
                    count = torch.tensor([self.generated[token] + extra], dtype=torch.float32, device=logits.device)
                    out[row, token:token + 1] = self.penalties.penalised(logits[row, token:token + 1], count)
        return out

    def _context_columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids the penalties touch before this pass's drafts, and how often each was generated."""
        if self._columns is None or self._columns[0].device != device:
            ids = sorted(self.prompt | self.generated.keys())
            self._columns = (torch.tensor(ids, dtype=torch.long, device=device),
                             torch.tensor([self.generated[i] for i in ids], dtype=torch.float32, device=device))
        return self._columns
