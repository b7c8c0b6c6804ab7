"""Structured output: text held to a JSON schema, a regular expression or a grammar.

llguidance compiles the structure into a matcher over the tokenizer's tokens; before each
choice the matcher gives the ids that keep the text on course, and every other id's logit
becomes -inf. Speculative decoding stays exact because each row of a verification pass is
masked as a plain step at that position would be: row i by a copy of the matcher that has
read the output and the first i drafts, while the request's matcher reads only the output. A
draft model proposes under the same masks, so its drafts are ones the target may keep.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.sampling import greedy_tokens


class StructureError(VerispecError):
    """A schema or regular expression the matcher cannot compile, or one asked for wrongly."""


@dataclass(frozen=True)
class Structure:
    """What the output must be, as an llguidance grammar, and in words for messages."""

    grammar: str
    description: str

    @classmethod
    def json(cls, schema: dict[str, Any] | bool = True) -> "Structure":
        """JSON that satisfies `schema`; True: any JSON object."""
        from llguidance import LLMatcher

        if schema is True:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise StructureError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        try:
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except ValueError as exc:
            raise StructureError(f"the JSON schema could not be read: {exc}") from None
        return cls._checked(grammar, "the JSON schema")

    @classmethod
    def regex(cls, pattern: str) -> "Structure":
        """Text that the regular expression matches whole."""
        from llguidance import LLMatcher

        if not isinstance(pattern, str) or not pattern:
            raise StructureError("a regular expression is a non-empty string")
        return cls._checked(LLMatcher.grammar_from_regex(pattern), "the regular expression")

    @classmethod
    def lark(cls, grammar: str) -> "Structure":
        """Text that a Lark grammar, in llguidance's dialect, derives from `start` (which may
        embed JSON schemas as `%json {...}` and tokens as `<[id]>`)."""
        from llguidance import LLMatcher

        if not isinstance(grammar, str) or not grammar.strip():
            raise StructureError("a grammar is a non-empty string")
        try:
            compiled = LLMatcher.grammar_from_lark(grammar)
        except ValueError as exc:
            raise StructureError(f"the grammar could not be read: {exc}") from None
        return cls._checked(compiled, "the grammar")

    @classmethod
    def _checked(cls, grammar: str, description: str) -> "Structure":
        """The structure, once its grammar compiles (without a tokenizer, so that a bad one is
        refused before any model loads)."""
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise StructureError(f"{description} could not be compiled: {error.strip()}")
        return cls(grammar, description)


STRUCTURE_KINDS = {"json": "a JSON schema", "regex": "a regular expression", "grammar": "a grammar"}


def asked_structure(json_schema: dict[str, Any] | bool | None, regex: str | None,
                    grammar: str | None = None) -> tuple[str, Any] | None:
    """(kind, value) of the one structure that `json_schema`, `regex` and `grammar` ask for
    (a kind of STRUCTURE_KINDS), or None for none; asking for more than one is an error."""
    asked = [(kind, value) for kind, value in (("json", json_schema), ("regex", regex), ("grammar", grammar))
             if value not in (None, False)]
    if len(asked) > 1:
        raise StructureError(f"ask for one structure at most, not {' and '.join(STRUCTURE_KINDS[k] for k, _ in asked)}")
    return asked[0] if asked else None


def structure_of(json_schema: dict[str, Any] | bool | None, regex: str | None,
                 grammar: str | None = None) -> Structure | None:
    """The structure that stream()'s `json_schema`, `regex` and `grammar` ask for, if any (one at most)."""
    asked = asked_structure(json_schema, regex, grammar)
    if asked is None:
        return None
    kind, value = asked
    return {"json": Structure.json, "regex": Structure.regex, "grammar": Structure.lark}[kind](value)


def request_structure(json_schema: dict[str, Any] | bool | None, regex: str | None, tokenizer, vocab_size: int,
                      ignore_eos: bool = False, min_tokens: int = 0,
                      grammar: str | None = None) -> "StructureState | None":
    """A request's structure compiled for the model's tokenizer, or None if it asks for none.
    A structured output ends where its structure does, so ignore_eos and min_tokens, which
    would hold the end off, are refused with it."""
    structure = structure_of(json_schema, regex, grammar)
    if structure is None:
        return None
    if ignore_eos or min_tokens:
        raise StructureError("a structured output ends where its structure does: leave out ignore_eos and min_tokens")
    return StructureState(structure, tokenizer, vocab_size)


class _TokenTable:
    """What llguidance reads of a tokenizer: each id's bytes, the special ids, encoding.

    Special to llguidance are the ids that decoding leaves out of the text. An added token that
    stays in it (Qwen2.5's <tool_call>) is text like any other: listed as special, its text
    in a grammar was allowed by the mask as that one token, which the matcher then refused."""

    def __init__(self, tokenizer, vocab_size: int):
        self.encode = tokenizer.encode
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in tokenizer.hidden_ids if i < vocab_size)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False)


def matcher_tokenizer(tokenizer, vocab_size: int):
    """The llguidance tokenizer of a verispec one, over the model's `vocab_size` ids, built once
    per tokenizer (reading 151,936 tokens' bytes takes half a second)."""
    import llguidance

    cached = getattr(tokenizer, "_matcher_tokenizer", None)
    if cached is None or cached[0] != vocab_size:
        table = llguidance.TokenizerWrapper(_TokenTable(tokenizer, vocab_size))
        built = llguidance.LLTokenizer(table, n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_ids) or None)
        cached = (vocab_size, built)
        tokenizer._matcher_tokenizer = cached
    return cached[1]


def _refuse(row: torch.Tensor, allowed: torch.Tensor) -> None:
    """-inf in `row` wherever `allowed` is False. A float32 row on the CPU is filled by NumPy's
    masked copy: with it a sampled row held to JSON was masked in 193 us against 276 with
    torch's masked_fill_ (benchmarks/structure_mask.py, Zen 4); other rows by torch."""
    if row.device.type == "cpu" and row.dtype == torch.float32:
        np.copyto(row.numpy(), np.float32(-np.inf), where=~allowed.numpy())
    else:
        row.masked_fill_(~allowed.to(row.device), float("-inf"))


class StructureState:
    """A request's matcher, kept at the output so far; `apply` masks a pass's rows, and has the
    interface of verispec.penalties.PenaltyState, so the two chain (`LogitsRules`)."""

    def __init__(self, structure: Structure, tokenizer, vocab_size: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(matcher_tokenizer(tokenizer, vocab_size), structure.grammar, log_level=0)
        if self.matcher.is_error():
            raise StructureError(f"{structure.description} could not be compiled: {self.matcher.get_error()}")
        self.vocab_size = vocab_size

    def add(self, tokens: Sequence[int]) -> None:
        """Tokens that joined the output (never an end-of-text token: the text ends there)."""
        tokens = list(tokens)
        if tokens and not self.matcher.consume_tokens(tokens):
            raise StructureError(f"the output left its structure: {self.matcher.get_error()}")

    def allowed(self, drafts: Sequence[int] = (), before: Sequence[int] = (), rows: int = 1) -> torch.Tensor:
        """[rows, vocab] booleans: the ids each row may choose, row i after the output, `before`
        and drafts[:i]. Rows after a token the structure refuses allow every id: verification
        stops at that token, so no choice is made from them."""
        out = torch.ones(rows, self.vocab_size, dtype=torch.bool)
        for row, matcher in self._looking_ahead(drafts, before, rows):
            out[row] = self._mask(matcher)
        return out

    def _looking_ahead(self, drafts: Sequence[int], before: Sequence[int], rows: int) -> Iterator[tuple[int, Any]]:
        """(row, a matcher after the output, `before` and drafts[:row]) for each row that makes a
        choice, up to the first token the structure refuses.

        The look ahead runs on a copy of the matcher (a few microseconds): llguidance 1.9.1's
        rollback after a mask computed ahead can leave the matcher in another state than the
        tokens it holds, which then refuses what a plain step allows
        (tests/test_structured.py, test_looking_ahead_leaves_the_matcher_as_it_was)."""
        ahead = self.matcher.deep_copy()
        if ahead.try_consume_tokens(list(before)) != len(before):
            return
        for row in range(rows):
            yield row, ahead
            if row == rows - 1 or ahead.try_consume_tokens([drafts[row]]) != 1:
                return

    def _mask(self, matcher) -> torch.Tensor:
        """The ids allowed next, from the matcher's bitmask: bit k of byte b is id 8b + k
        (NumPy unpacks the bits in one call, where shifts in torch take several passes)."""
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].view(np.bool_))

    def apply(self, logits: torch.Tensor, drafts: Sequence[int] = (), before: Sequence[int] = (),
              column_of=None, greedy: bool = False) -> torch.Tensor:
        """Rows [rows, width] with the ids the structure refuses at -inf. The columns are the
        token ids, or where `column_of` is given, those of its `ids` (a draft limited to its
        first ids and the context's).

        With `greedy` (the caller takes each row's argmax), a row whose argmax the structure
        allows is left as it is: masked, its argmax would be that same id, still the first of
        its equal maxima. Only a row whose argmax is refused pays for the mask, a pass over
        the vocabulary where checking one id takes under a microsecond."""
        width = logits.shape[-1]
        choices = greedy_tokens(logits) if greedy else None
        if choices is not None and column_of is not None:  # the columns' token ids
            choices = column_of.ids(width)[choices].tolist()
        out = None
        for row, matcher in self._looking_ahead(drafts, before, logits.shape[0]):
            if choices is not None and choices[row] < self.vocab_size and matcher.validate_tokens([choices[row]]):
                continue
            allowed = self._columns(self._mask(matcher), width, column_of)
            out = logits.clone() if out is None else out
            _refuse(out[row], allowed)
        return logits if out is None else out

    def _columns(self, allowed: torch.Tensor, width: int, column_of) -> torch.Tensor:
        """One row's allowed ids laid out as the logits' `width` columns: the ids of `column_of`,
        or the first ids, columns past the vocabulary (a padded embedding) refused."""
        if column_of is not None:
            return allowed[column_of.ids(width)]
        if width <= self.vocab_size:
            return allowed[:width]
        return torch.nn.functional.pad(allowed, (0, width - self.vocab_size))
