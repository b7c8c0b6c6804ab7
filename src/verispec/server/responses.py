"""Response bodies in OpenAI's schema, plus the speculative statistics under a `verispec` key."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from verispec.events import GenerationResult

# verispec's reasons -> OpenAI's: the end-of-text token and a stop string are both "stop"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(result: GenerationResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion}


def decoding_summary(result: GenerationResult, draft: str | None) -> dict[str, Any]:
    """Timings, and for speculative decoding what the target kept of the drafts."""
    t = result.timings
    out: dict[str, Any] = {"draft": draft, "prefill_s": round(t.prefill_s, 4), "decode_s": round(t.decode_s, 4),
                           "tokens_per_s": round(t.tokens_per_s, 2)}
    spec = result.spec
    if spec is None:
        return out
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


@dataclass
class ResponseShape:
    """The ids, timestamps and shapes one response and its chunks share."""

    model: str
    chat: bool
    draft: str | None = None
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, result: GenerationResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        choice.update(logprobs=None, finish_reason=FINISH_REASONS[result.finish_reason])
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage(result)
        body["verispec"] = decoding_summary(result, self.draft)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        """A streamed piece: a delta for chat, a text piece for completions."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish_reason)
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def final_chunk(self, result: GenerationResult, tail: str) -> dict[str, Any]:
        body = self.chunk(tail if tail or not self.chat else None, FINISH_REASONS[result.finish_reason])
        body["verispec"] = decoding_summary(result, self.draft)
        return body

    def usage_chunk(self, result: GenerationResult) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(result)
        return body
