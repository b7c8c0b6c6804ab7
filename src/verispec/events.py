"""The one stream of events that baseline and speculative decoding produce.

The CLI, the server and the lab all consume it: `Token` for every emitted token,
then one `Finished` with the whole result, timings and statistics. A request that
asks for the prompt's log-probabilities gets a `Prompt` first, once the prompt is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

# where an emitted token came from:
#   target     plain decoding (or the first token, from the prefill pass); counted as `plain`
#   draft      a drafted token the target kept ("accepted")
#   recovered  the target's own token at the first rejected draft position
#   bonus      the target's extra token after every draft was kept
Origin = Literal["target", "draft", "recovered", "bonus"]


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows


@dataclass(slots=True, frozen=True)
class Logprob:
    """The target's log-probability of an emitted token, from the logits of the pass that
    chose or checked it (before temperature, top-k and top-p), and the `top` most likely ids
    there as (id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {"logprob": self.logprob, "top": [list(pair) for pair in self.top]}


@dataclass(slots=True)
class Prompt:
    """The prompt as the target read it: its token ids, and each one's log-probability given
    the tokens before it (None for the first, which has nothing before it)."""

    token_ids: list[int]
    logprobs: list[Logprob | None]


@dataclass(slots=True)
class Token:
    token_id: int
    text: str  # newly printable text; "" while a character or a possible stop string is incomplete
    origin: Origin
    index: int  # position among the generated tokens
    round: int  # which target pass produced or confirmed it
    logprob: Logprob | None = None  # when the request asks for log-probabilities


@dataclass
class Timings:
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens_per_s: float = 0.0  # tokens after the first / decode_s (prefill excluded)


@dataclass
class SpecStats:
    rounds: int = 0  # target passes, the prefill pass included
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0  # the target's token after a round whose drafts were all kept
    plain: int = 0  # tokens of passes that checked no drafts: the first token, --adaptive's plain steps
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    catch_up_s: float = 0.0  # of draft_s: the draft reading context it had skipped (--adaptive)
    lookup_drafted: int = 0  # of drafted and accepted: prompt lookup's, in a draft model's place (--adaptive)
    lookup_accepted: int = 0
    verify_s: float = 0.0
    gammas: list[int] = field(default_factory=list)  # γ of every round, for adaptive schedules
    draft_vocab: int | None = None  # the first ids a draft model proposed (with the context's); None: all

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens(self) -> int:
        return self.accepted + self.recovered + self.bonus + self.plain

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    def record_position(self, position: int, accepted: bool) -> None:
        while len(self.drafted_by_position) <= position:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        self.drafted_by_position[position] += 1
        self.accepted_by_position[position] += int(accepted)

    @classmethod
    def combined(cls, parts: list[SpecStats]) -> SpecStats:
        """Several decodings' statistics as one: counts and times added, position by position
        for the per-position counts; γ's in order."""
        out = cls(draft_vocab=parts[0].draft_vocab if parts else None)
        for part in parts:
            for name in _ADDED_UP:
                setattr(out, name, getattr(out, name) + getattr(part, name))
            missing = len(part.drafted_by_position) - len(out.drafted_by_position)
            out.drafted_by_position += [0] * missing
            out.accepted_by_position += [0] * missing
            for position, (accepted, drafted) in enumerate(zip(part.accepted_by_position,
                                                               part.drafted_by_position)):
                out.accepted_by_position[position] += accepted
                out.drafted_by_position[position] += drafted
            out.gammas.extend(part.gammas)
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_pass=self.tokens_per_pass,
                   acceptance_by_position=self.acceptance_by_position)
        return out


_ADDED_UP = ("rounds", "drafted", "accepted", "recovered", "bonus", "plain", "draft_s", "catch_up_s",
             "lookup_drafted", "lookup_accepted", "verify_s")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    origins: list[str]
    prompt_tokens: int
    finish_reason: Literal["stop", "length", "eos"]
    timings: Timings
    spec: SpecStats | None = None  # None for baseline decoding
    logprobs: list[Logprob] | None = None  # one per token id, when asked for
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token (see Prompt), when asked for

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "timings": asdict(self.timings),
        }
        if self.spec is not None:
            out["spec"] = self.spec.to_dict()
        if self.logprobs is not None:
            out["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [lp.to_dict() if lp is not None else None for lp in self.prompt_logprobs]
        return out


@dataclass(slots=True)
class Finished:
    result: GenerationResult
    tail: str = ""  # text held back while it could have begun a stop string, never streamed


Event = Prompt | Token | Finished
