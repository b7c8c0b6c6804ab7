"""Response bodies in OpenAI's schema, plus the speculative statistics under a `verispec` key."""

from __future__ import annotations

import codecs
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from verispec.events import GenerationResult, Logprob, SpecStats
from verispec.server.tools import ToolCall, parse_tool_calls

# verispec's reasons -> OpenAI's: the end-of-text token and a stop string are both "stop"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(results: Sequence[GenerationResult], per_prompt: int = 1) -> dict[str, int]:
    """One request's tokens: each prompt once (its `per_prompt` choices come one after
    another), every choice's completion."""
    prompt = sum(r.prompt_tokens for r in results[::per_prompt])
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def decoding_summary(result: GenerationResult | Sequence[GenerationResult], draft: str | None) -> dict[str, Any]:
    """Timings, and for speculative decoding what the target kept of the drafts; of several
    choices, the sums of their counts and times and the rates of those sums."""
    parts = [result] if isinstance(result, GenerationResult) else list(result)
    prefill_s, decode_s = sum(r.timings.prefill_s for r in parts), sum(r.timings.decode_s for r in parts)
    after_first = sum(max(len(r.token_ids) - 1, 0) for r in parts)
    tokens_per_s = after_first / decode_s if decode_s > 0 else 0.0  # as Timings.tokens_per_s has it
    out: dict[str, Any] = {"draft": draft, "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
                           "tokens_per_s": round(tokens_per_s, 2)}
    if parts[0].spec is None:
        return out
    spec = parts[0].spec if len(parts) == 1 else SpecStats.combined([r.spec for r in parts])
    drafting_rounds = [g for g in spec.gammas if g > 0]
    out.update(
        acceptance_rate=round(spec.acceptance_rate, 4),
        tokens_per_pass=round(spec.tokens_per_pass, 4),
        target_passes=spec.rounds,
        drafted=spec.drafted,
        accepted=spec.accepted,
        recovered=spec.recovered,
        bonus=spec.bonus,
        plain=spec.plain,
        acceptance_by_position=[round(a, 4) for a in spec.acceptance_by_position],
        mean_gamma=round(sum(drafting_rounds) / len(drafting_rounds), 2) if drafting_rounds else 0.0,
        draft_s=round(spec.draft_s, 4),
        catch_up_s=round(spec.catch_up_s, 4),
        lookup_drafted=spec.lookup_drafted,
        lookup_accepted=spec.lookup_accepted,
        verify_s=round(spec.verify_s, 4),
    )
    return out


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: `data: {...}` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, answered before its text (`echo`): the text as sent (or decoded
    from the ids sent) and its token ids."""

    text: str
    ids: list[int]


class LogprobsShape:
    """Log-probabilities in OpenAI's shapes: chat's `content` list (token, logprob, bytes,
    top_logprobs), or the completions API's parallel lists (tokens, token_logprobs,
    top_logprobs, text_offset). One per response: a stream's chunks continue its text offsets."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # characters of the completion before the next token
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def body(self, ids: Sequence[int], logprobs: Sequence[Logprob | None]) -> dict[str, Any]:
        """The entries of these consecutive tokens; None for a prompt's first token, which has
        no log-probability (completions only)."""
        if self.chat:
            return {"content": [self._chat_entry(i, lp) for i, lp in zip(ids, logprobs)], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in zip(ids, logprobs):
            raw = self.tokenizer.token_bytes(token_id)
            text = _as_text(raw)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            # vLLM's shape: the alternatives and the token itself
            out["top_logprobs"].append(None if lp is None else {
                **{_as_text(self.tokenizer.token_bytes(i)): v for i, v in lp.top}, text: lp.logprob})
            out["text_offset"].append(self.offset)
            self.offset += len(self.decoder.decode(raw))
        return out

    def _chat_entry(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        entry = self._alternative(token_id, lp.logprob)
        entry["top_logprobs"] = [self._alternative(i, v) for i, v in lp.top]
        return entry

    def _alternative(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.tokenizer.token_bytes(token_id)
        return {"token": _as_text(raw), "logprob": logprob, "bytes": list(raw)}


def _as_text(raw: bytes) -> str:
    """A token's bytes as text; part of a character reads as U+FFFD."""
    return raw.decode("utf-8", errors="replace")


@dataclass
class ResponseShape:
    """The ids, timestamps and shapes one response and its chunks share."""

    model: str
    chat: bool
    draft: str | None = None
    logprobs: list[LogprobsShape] | None = None  # one per choice, when the request asks for log-probabilities
    echoes: list[Echo | None] | None = None  # per choice: its prompt, when a completion asks for it first
    per_prompt: int = 1  # choices of each prompt (n), which come one after another
    tool_names: set[str] | None = None  # chat: the functions an answer may call, read out of its text
    single_call: bool = False  # chat: parallel calls off, so an answer ends with its first call
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def echo(self, index: int) -> Echo | None:
        """The prompt that choice `index` answers before its text, if it asked for it."""
        return self.echoes[index] if self.echoes else None

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        body = self._envelope("chat.completion" if self.chat else "text_completion",
                              [self._choice(index, result) for index, result in enumerate(results)])
        body["usage"] = usage(results, self.per_prompt)
        body["verispec"] = decoding_summary(results, self.draft)
        return body

    def _choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        finish_reason = FINISH_REASONS[result.finish_reason]
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
            if self.tool_names is not None:
                content, calls = parse_tool_calls(result.text, self.tool_names, single=self.single_call)
                if calls:
                    choice["message"].update(content=content, tool_calls=[call.body() for call in calls])
                    finish_reason = "tool_calls"
        else:
            echo = self.echo(index)
            choice["text"] = (echo.text if echo else "") + result.text
        logprobs = None
        if self.logprobs is not None and result.logprobs is not None:
            ids, values = result.token_ids, result.logprobs
            echo = self.echo(index)
            if echo is not None and result.prompt_logprobs is not None:
                ids, values = [*echo.ids, *ids], [*result.prompt_logprobs, *values]
            logprobs = self.logprobs[index].body(ids, values)
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return choice

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              tokens: Sequence[tuple[int, Logprob | None]] = (), index: int = 0) -> dict[str, Any]:
        """A streamed piece of choice `index`: a delta for chat, a text piece for completions;
        with the log-probabilities of `tokens` (id, logprob), those whose text it carries."""
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        logprobs = None
        if self.logprobs is not None and tokens:
            logprobs = self.logprobs[index].body([i for i, _ in tokens], [lp for _, lp in tokens])
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def calls_chunk(self, calls: Sequence[ToolCall], index: int = 0) -> dict[str, Any]:
        """A chat choice's tool calls, whole, in one streamed delta."""
        body = self.chunk(None, index=index)
        body["choices"][0]["delta"]["tool_calls"] = [call.body(i) for i, call in enumerate(calls)]
        return body

    def final_chunk(self, result: GenerationResult, tail: str,
                    tokens: Sequence[tuple[int, Logprob]] = (), index: int = 0,
                    called: bool = False) -> dict[str, Any]:
        """The last piece of a choice; `called`: its answer made tool calls (sent before it)."""
        finish_reason = "tool_calls" if called else FINISH_REASONS[result.finish_reason]
        body = self.chunk(tail if tail or not self.chat else None, finish_reason, tokens=tokens, index=index)
        body["verispec"] = decoding_summary(result, self.draft)
        return body

    def usage_chunk(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(results, self.per_prompt)
        return body
