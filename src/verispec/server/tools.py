"""Tool calls on the chat API, in the form Hermes-style chat templates (Qwen2.5's among them)
teach the model: each call one JSON object, {"name": ..., "arguments": {...}}, between
<tool_call> and </tool_call>.

The request's tools go into the chat template, which describes them to the model. With
`tool_choice` "auto" the model decides, and the calls are read out of its answer; "required"
or a named function holds the answer to calls (a grammar for `verispec.structured`), so that
it makes one and its arguments satisfy the function's parameter schema; "none" leaves the
tools out of the prompt. Small models often answer with the call alone, as JSON, without the
tags (Qwen2.5-Coder 1.5B puts it in a ```json block): an answer that is nothing but one call
of a tool, fenced so or bare, is read as that call too. Speculative decoding is unchanged by
any of it: the answer is the text plain decoding would give, read afterwards.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
FENCE = "```json"
# a whole answer that is one JSON object, bare or in a ```json block
BARE_CALL = re.compile(r"\s*(?:" + FENCE + r"[ \t]*\n)?\s*(\{.*\})\s*(?:```)?\s*", re.DOTALL)


def template_calls_tools(chat_template: str | None) -> bool:
    """Whether a chat template takes tools and has the model call them between <tool_call> tags."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape; with `index` as a streamed delta carries it."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out


def parse_tool_calls(text: str, names: set[str], bare: bool = True,
                     single: bool = False) -> tuple[str | None, list[ToolCall]]:
    """An answer's content and its calls of the functions in `names`. The content is the text
    outside the calls (None if there is none); a block that is not a call of one of the
    functions stays in it. With `bare`, an answer that is one call and nothing else, without
    the tags, is that call. With `single` (parallel calls off), the answer ends with its
    first call. An answer without calls is its text unchanged."""
    parts, calls = _split(text, names, single)
    if calls:
        return _content(parts) or None, calls
    whole = BARE_CALL.fullmatch(text) if bare else None
    call = _call(whole.group(1), names) if whole else None
    return (None, [call]) if call else (text, [])


def _split(text: str, names: set[str], single: bool = False) -> tuple[list[str], list[ToolCall]]:
    """The calls in `text`, and the pieces of text before, between and after them; with
    `single`, the first call and the text before it."""
    parts, calls, start = [], [], 0
    for match in CALL.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        parts.append(text[start:match.start()])
        start = match.end()
        calls.append(call)
        if single:
            return [*parts, ""], calls
    return [*parts, text[start:]], calls


def _content(parts: list[str], after_text: bool = False) -> str:
    """The pieces of text around calls as one: the whitespace next to a call is its layout, and
    pieces join on a new line. `after_text`: the first piece continues text already sent."""
    first, others = parts[0].rstrip(), [p.strip() for p in parts[1:] if p.strip()]
    return "\n".join(([first] if first or (after_text and others) else []) + others)


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


class CallHolder:
    """A streamed answer's text, sent as it comes until a call may be starting; from there it is
    held, and read for calls when the answer ends. What it sends, and then what `finish` gives,
    add up to the content `parse_tool_calls` reads out of the whole answer."""

    def __init__(self, names: set[str], single: bool = False):
        self.names, self.single = names, single
        self.sent = False  # whether any text went out
        self.pending = ""  # text that may be the start of <tool_call>, or whitespace before one
        self.held: str | None = None  # everything from the first <tool_call> on

    def feed(self, text: str) -> str:
        """The part of `text` that can be sent now."""
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        if not self.sent:  # a whole answer that is one call, without the tags, starts so
            start = self.pending.lstrip()
            if start.startswith(("{", FENCE)):
                self.held, self.pending = self.pending, ""
                return ""
            if FENCE.startswith(start):
                return ""
        found = self.pending.find(OPEN)
        if found >= 0:
            self.pending, self.held = self.pending[:found], self.pending[found:]
            end = len(self.pending)
        else:
            end = len(self.pending) - _longest_start(self.pending, OPEN)
        end = len(self.pending[:end].rstrip())  # whitespace before a call is the call's layout
        ready, self.pending = self.pending[:end], self.pending[end:]
        self.sent = self.sent or bool(ready)
        return ready

    def finish(self, tail: str) -> tuple[str, list[ToolCall]]:
        """The text still to send and the answer's calls, once its last text (`tail`) is in."""
        rest = self.pending + (self.held or "") + tail
        if not self.sent:  # the whole answer is here
            content, calls = parse_tool_calls(rest, self.names, single=self.single)
            return (content or "", calls) if calls else (rest, [])
        parts, calls = _split(rest, self.names, self.single)
        return (_content(parts, after_text=True), calls) if calls else (rest, [])


def _longest_start(text: str, word: str) -> int:
    """The length of the longest end of `text` that `word` starts with."""
    for size in range(min(len(text), len(word) - 1), 0, -1):
        if word.startswith(text[-size:]):
            return size
    return 0


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call of `function` (an OpenAI function definition)."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def calls_grammar(functions: list[dict[str, Any]], several: bool) -> str:
    """A Lark grammar (llguidance's dialect) for an answer made of calls of `functions`: one
    call, or with `several` one or more, each on its own lines as the template shows them.
    The tags are text, which a tokenizer with a token for each (Qwen2.5's) writes in one."""
    schemas = [call_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # the JSON laid out as the template writes calls: a space after each colon and comma
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                       "item_separator": ", "}}
    start = 'call ("\\n" call)*' if several else "call"
    return "\n".join([f"start: {start}",
                      f'call: {json.dumps(OPEN)} "\\n" arguments "\\n" {json.dumps(CLOSE)}',
                      f"arguments: %json {json.dumps(schema)}"])
