"""Logit bias, penalties on repeating and min_tokens: the target's logits adjusted per request.

As vLLM and OpenAI define them: `logit_bias` adds a fixed amount to chosen ids' logits;
then `repetition` (CTRL's penalty) divides a positive logit by r
and multiplies a negative one by r, for every id in the prompt or the output; then
`frequency` subtracts f for each time an id was generated and `presence` subtracts p once
an id has been generated at all; before `min_tokens` tokens, the ids that end the text
are ruled out. Plain decoding with penalties is the penalised target's
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
    min_tokens: int = 0  # tokens before the end-of-text and stop token ids may be chosen

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not is_whole(self.min_tokens, 0):
            raise VerispecError(f"min tokens must be a whole number >= 0, got {self.min_tokens!r}")
        for name, value in (("presence", self.presence), ("frequency", self.frequency)):
            if not is_number(value, -MAX_ADDITIVE, MAX_ADDITIVE):
                raise VerispecError(f"the {name} penalty must be a number from -2 to 2, got {value!r}")
        if not is_number(self.repetition) or self.repetition <= 0:
            raise VerispecError(f"the repetition penalty must be a number > 0 (1: none), got {self.repetition!r}")

    @property
    def active(self) -> bool:
        return (self.presence != 0 or self.frequency != 0 or self.repetition != 1 or bool(self.logit_bias)
                or self.min_tokens > 0)

    def penalised(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`logits` of ids that appear in the context, each generated counts[i] times (0: only
        in the prompt); one function for whole rows and single entries, so both round alike."""
        if self.repetition != 1:
            logits = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        return logits - self.frequency * counts - self.presence * (counts > 0).float()


ColumnOf = Callable[[int], "int | None"]  # a token id's column in rows that are not over the ids themselves


class PenaltyState:
    """One request's adjustments and what its text holds: the prompt's ids (for the repetition
    penalty), how often each id was generated, and how many tokens were (for min_tokens,
    which holds off `end_ids`)."""

    def __init__(self, penalties: Penalties, prompt_ids: Iterable[int], end_ids: Iterable[int] = ()):
        self.penalties = penalties
        self.generated: Counter[int] = Counter()
        self.length = 0
        self.prompt = set(prompt_ids) if penalties.repetition != 1 else set()
        self.end_ids = sorted(end_ids) if penalties.min_tokens else []
        self._cache: dict[str, tuple] = {}  # name -> (key, columns, values)
        self._scratch: torch.Tensor | None = None  # where reused rows are written (see apply)

    def add(self, tokens: Iterable[int]) -> None:
        """Tokens that joined the output."""
        tokens = list(tokens)
        self.generated.update(tokens)
        self.length += len(tokens)
        self._cache.pop("context", None)

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = (), before: Sequence[int] = (),
              column_of: ColumnOf | None = None, reuse: bool = False) -> torch.Tensor:
        """Penalised copies of rows [rows, width]: row i follows the output, then `before`, then
        drafts[:i]. The rows' columns are the token ids, or where `column_of` is given, what it
        maps each id to (None: the id has no column), as a draft limited to its first ids and
        the context's has them; one `column_of` serves a round's calls. The bias comes first,
        as in vLLM, so the repetition penalty scales biased logits; min_tokens's rule last.

        With `reuse`, the copy is written where the last such call wrote, valid until the next:
        for a caller done with the rows before it calls again. A pass's rows are megabytes, and
        a fresh block that size is new memory the kernel zeroes on first touch, most of a
        penalised pass's cost (benchmarks/penalty_cost.py)."""
        width = logits.shape[-1]
        key = (column_of, width, logits.device)
        if self.penalties.logit_bias:
            columns, amounts = self._columns("bias", key, lambda: self.penalties.logit_bias)
            logits = logits.clone()
            logits[:, columns] += amounts
        out = self._reused(logits) if reuse else logits.clone()
        columns, counts = self._columns(
            "context", key, lambda: [(i, self.generated[i]) for i in sorted(self.prompt | self.generated.keys())])
        if columns.numel():
            out[:, columns] = self.penalties.penalised(logits[:, columns], counts)
        rows, row_columns, row_counts = self._row_entries(logits.shape[0], drafts, before, width, column_of)
        if rows:  # the ids `before` and the drafts before each row add to it, every row in one call
            at = (torch.tensor(rows, device=logits.device), torch.tensor(row_columns, device=logits.device))
            counts = torch.tensor(row_counts, dtype=torch.float32, device=logits.device)
            out[at] = self.penalties.penalised(logits[at], counts)
        early = min(logits.shape[0], self.penalties.min_tokens - self.length - len(before))
        if early > 0 and self.end_ids:  # rows that choose a token before min_tokens cannot end the text
            columns, _ = self._columns("end", key, lambda: [(i, 0.0) for i in self.end_ids])
            out[:early, columns] = float("-inf")
        return out

    def _row_entries(self, rows: int, drafts: Sequence[int], before: Sequence[int], width: int,
                     column_of: ColumnOf | None) -> tuple[list[int], list[int], list[float]]:
        """(row, column, count) of each id that `before` and drafts[:row] add to row `row`'s
        context, the count being how often the output and they hold it."""
        at_rows, columns, counts = [], [], []
        for row in range(rows):
            for token, extra in Counter([*before, *drafts[:row]]).items():
                column = _column(token, width, column_of)
                if column is not None:
                    at_rows.append(row)
                    columns.append(column)
                    counts.append(float(self.generated[token] + extra))
        return at_rows, columns, counts

    def _reused(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` in the scratch rows, grown when too few or of another kind."""
        rows, width = logits.shape
        scratch = self._scratch
        if (scratch is None or scratch.shape[0] < rows or scratch.shape[1] != width or scratch.dtype != logits.dtype
                or scratch.device != logits.device):
            self._scratch = scratch = torch.empty(max(rows, 8), width, dtype=logits.dtype, device=logits.device)
        return scratch[:rows].copy_(logits)

    def _columns(self, name: str, key: tuple, pairs: Callable[[], Iterable[tuple[int, float]]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(id, value) pairs as their columns under `key` (column_of, width, device) and their
        values, ids without a column left out; kept until the key or the output changes."""
        cached = self._cache.get(name)
        if cached is None or cached[0] != key:
            column_of, width, device = key
            kept = [(column, value) for token, value in pairs()
                    if (column := _column(token, width, column_of)) is not None]
            cached = (key, torch.tensor([c for c, _ in kept], dtype=torch.long, device=device),
                      torch.tensor([v for _, v in kept], dtype=torch.float32, device=device))
            self._cache[name] = cached
        return cached[1], cached[2]


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


class LogitsRules:
    """A request's rules on the logits, applied to every row that chooses a token: the penalty
    state, then a structure's mask (verispec.structured.StructureState), which must come last,
    since -inf is final. Each has `add` (tokens that joined the output) and `apply` (rows,
    drafts, before, column_of)."""

    def __init__(self, penalty: PenaltyState | None = None, structure=None):
        self.penalty = penalty
        self.structure = structure

    def __bool__(self) -> bool:
        return self.penalty is not None or self.structure is not None

    def add(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        for rule in (self.penalty, self.structure):
            if rule is not None:
                rule.add(tokens)

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = (), before: Sequence[int] = (),
              column_of: ColumnOf | None = None, greedy: bool = False, reuse: bool = False) -> torch.Tensor:
        """The rows with the rules applied; with `greedy`, for a caller that takes each row's
        argmax, which the structure then masks only where it refuses it (StructureState.apply);
        with `reuse`, for a caller done with them before it calls again (PenaltyState.apply)."""
        if self.penalty is not None:
            logits = self.penalty.apply(logits, drafts, before, column_of, reuse=reuse)
        if self.structure is not None:
            logits = self.structure.apply(logits, drafts, before, column_of, greedy=greedy)
        return logits

    def as_read(self, logits: torch.Tensor, drafts: Sequence[int]) -> "RowsAsRead":
        """A verification pass's rows [rows, vocab] with the rules applied to each as it is
        first read: what `apply(logits, drafts)` gives, for a reader that stops early."""
        return RowsAsRead(logits, self, drafts)


class RowsAsRead:
    """Rows of a pass, each ruled when first indexed. Sampled verification reads rows up to its
    first rejection, and a structure's mask costs a sampled row a pass over the vocabulary
    (benchmarks/structure_mask.py), so the rows after the rejection are never ruled."""

    def __init__(self, logits: torch.Tensor, rules: LogitsRules, drafts: Sequence[int]):
        self.logits, self.rules, self.drafts = logits, rules, list(drafts)
        self.ruled: dict[int, torch.Tensor] = {}

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self.ruled:  # row i follows drafts[:i], as in apply()
            self.ruled[row] = self.rules.apply(self.logits[row:row + 1], before=self.drafts[:row])[0]
        return self.ruled[row]
