"""Logit bias and penalties on repeating: the target's logits adjusted per request.

As vLLM and OpenAI define them: `logit_bias` adds a fixed amount to chosen ids' logits;
then `repetition` (CTRL's penalty) divides a positive logit by r
and multiplies a negative one by r, for every id in the prompt or the output; then
`frequency` subtracts f for each time an id was generated and `presence` subtracts p once
an id has been generated at all. Plain decoding with penalties is the penalised target's
output, and speculative decoding keeps it so: each row of a verification pass is penalised
by the output before its position, the drafts before it included. A draft model is
penalised alike, its own drafts counted as they come, so that it proposes what the
penalised target would; what a draft proposes costs acceptance only, never exactness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from verispec.errors import VerispecError
from verispec.values import is_number, is_whole

MAX_ADDITIVE = 2.0  # OpenAI's range for presence and frequency penalties: -2 to 2
MAX_BIAS = 100.0  # OpenAI's range for a logit bias: -100 (never) to 100 (always)


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    # (id, bias) pairs in id order; a {id: bias} mapping is accepted and put in that form
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name, value in (("presence", self.presence), ("frequency", self.frequency)):
            if not is_number(value, -MAX_ADDITIVE, MAX_ADDITIVE):
                raise VerispecError(f"the {name} penalty must be a number from -2 to 2, got {value!r}")
        if not is_number(self.repetition) or self.repetition <= 0:
            raise VerispecError(f"the repetition penalty must be a number > 0 (1: none), got {self.repetition!r}")

    @property
    def active(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1 or bool(self.logit_bias)

    def penalised(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`logits` of ids that appear in the context, each generated counts[i] times (0: only
        in the prompt); one function for whole rows and single entries, so both round alike."""
        if self.repetition != 1:
            logits = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        return logits - self.frequency * counts - self.presence * (counts > 0).float()


ColumnOf = Callable[[int], "int | None"]  # a token id's column in rows that are not over the ids themselves


class PenaltyState:
    """One request's bias and penalties and the ids its text holds: the prompt's (for the
    repetition penalty) and how often each was generated."""

    def __init__(self, penalties: Penalties, prompt_ids: Iterable[int]):
        self.penalties = penalties
        self.generated: Counter[int] = Counter()
        self.prompt = set(prompt_ids) if penalties.repetition != 1 else set()
        self._columns: tuple | None = None  # (column_of, width, device, columns, counts)
        self._bias: tuple | None = None  # (column_of, width, device, columns, amounts)

    def add(self, tokens: Iterable[int]) -> None:
        """Tokens that joined the output."""
        self.generated.update(tokens)
        self._columns = None

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = (), before: Sequence[int] = (),
              column_of: ColumnOf | None = None) -> torch.Tensor:
        """Penalised copies of rows [rows, width]: row i follows the output, then `before`, then
        drafts[:i]. The rows' columns are the token ids, or where `column_of` is given, what it
        maps each id to (None: the id has no column), as a draft limited to its first ids and
        the context's has them; one `column_of` serves a round's calls. The bias comes first,
        as in vLLM, so the repetition penalty scales biased logits."""
        width = logits.shape[-1]
        if self.penalties.logit_bias:
            logits = self._biased(logits, column_of)
        out = logits.clone()
        columns, counts = self._context_columns(logits.device, width, column_of)
        if columns.numel():
            out[:, columns] = self.penalties.penalised(logits[:, columns], counts)
        for row in range(logits.shape[0]):
            for token, extra in Counter([*before, *drafts[:row]]).items():
                column = _column(token, width, column_of)
                if column is not None:
                    count = torch.tensor([self.generated[token] + extra], dtype=torch.float32, device=logits.device)
                    out[row, column:column + 1] = self.penalties.penalised(logits[row, column:column + 1], count)
        return out

    def _biased(self, logits: torch.Tensor, column_of: ColumnOf | None) -> torch.Tensor:
        width, cached = logits.shape[-1], self._bias
        if cached is None or cached[0] is not column_of or cached[1] != width or cached[2] != logits.device:
            pairs = [(column, value) for token, value in self.penalties.logit_bias
                     if (column := _column(token, width, column_of)) is not None]
            columns = torch.tensor([c for c, _ in pairs], dtype=torch.long, device=logits.device)
            amounts = torch.tensor([v for _, v in pairs], dtype=logits.dtype, device=logits.device)
            self._bias = cached = (column_of, width, logits.device, columns, amounts)
        biased = logits.clone()
        biased[:, cached[3]] += cached[4]
        return biased

    def _context_columns(self, device: torch.device, width: int, column_of: ColumnOf | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The columns the penalties touch before `before` and the drafts, and how often each
        column's id was generated."""
        cached = self._columns
        if cached is None or cached[0] is not column_of or cached[1] != width or cached[2] != device:
            pairs = [(column, self.generated[i]) for i in sorted(self.prompt | self.generated.keys())
                     if (column := _column(i, width, column_of)) is not None]
            columns = torch.tensor([c for c, _ in pairs], dtype=torch.long, device=device)
            counts = torch.tensor([n for _, n in pairs], dtype=torch.float32, device=device)
            self._columns = cached = (column_of, width, device, columns, counts)
        return cached[3], cached[4]


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """A logit bias, checked, as (id, amount) pairs in id order."""
    if bias is None or isinstance(bias, (Mapping, list, tuple)):
        pairs = list(bias.items()) if isinstance(bias, Mapping) else list(bias or ())
    else:
        raise VerispecError(f"a logit bias maps token ids to amounts, got {bias!r}")
    for pair in pairs:
        token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (pair, None)
        if not is_whole(token, 0):
            raise VerispecError(f"a logit bias is keyed by a token id (a whole number >= 0), got {token!r}")
        if not is_number(value, -MAX_BIAS, MAX_BIAS):
            raise VerispecError(f"a logit bias must be a number from -100 to 100, got {value!r} for id {token}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise VerispecError("the logit bias names a token id twice")
    return tuple(sorted((token, float(value)) for token, value in pairs))


def _column(token: int, width: int, column_of: ColumnOf | None) -> int | None:
    column = token if column_of is None else column_of(token)
    return column if column is not None and column < width else None
