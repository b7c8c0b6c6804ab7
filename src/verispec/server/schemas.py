"""Request bodies of the OpenAI-compatible API, validated by pydantic.

Unknown fields are ignored, as OpenAI's own clients send many. Fields that
would change the answer in ways verispec does not implement (best_of, echo on
chat, tools on /v1/completions, the legacy functions, ...) are refused with a
clear message rather than silently dropped; their neutral values (null, 0,
false, 1, the default) are accepted.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verispec.events import MAX_TOP_LOGPROBS
from verispec.penalties import MAX_ADDITIVE, MAX_BIAS
from verispec.sampling import SEED_MAX, SEED_MIN

MAX_CHOICES = 128  # as OpenAI's chat API allows; on /v1/completions, n × the prompts of a batch

# field -> the values that ask for nothing beyond plain decoding
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # as OpenAI allows

# what a field whose type is a union accepts, for error messages
EXPECTED_SHAPES = {
    "prompt": "a string, a list of token ids, or a batch: a list of strings or of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is always kept


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON that a schema allows."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @property
    def wanted_schema(self) -> dict[str, Any] | bool | None:
        """What stream()'s json_schema takes: a schema, True for any JSON object, None for text."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is not None and self.json_schema.schema_ is not None:
            return self.json_schema.schema_
        return True


class DecodingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # any name is accepted; the served model answers
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; 0 or -1 turns it off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension: ids that end the text as a stop string does
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extension: nothing ends the text before these
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # completions of the prompt, one after another
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: decode past the end-of-text token
    presence_penalty: float | None = Field(default=None, ge=-MAX_ADDITIVE, le=MAX_ADDITIVE)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_ADDITIVE, le=MAX_ADDITIVE)
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's extension; 1 is none
    # token id (a JSON key, so a string of digits) -> the amount added to its logit
    logit_bias: dict[int, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None
    response_format: ResponseFormat | None = None  # the output held to JSON (verispec.structured)
    guided_regex: str | None = None  # vLLM's extension: the output held to a regular expression
    guided_grammar: str | None = None  # vLLM's extension: held to a Lark grammar (llguidance's dialect)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "DecodingRequest":
        for name, value in (self.model_extra or {}).items():
            if name == "best_of" and value == self.n:  # the best n of n: all of them
                continue
            if name in NEUTRAL_VALUES and value not in NEUTRAL_VALUES[name]:
                raise ValueError(f"{name}={value!r} is not supported by this server; leave it out")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def alternatives(self) -> int | None:
        """How many likeliest ids each token's log-probability comes with; None: no log-probabilities."""
        return None


class CompletionRequest(DecodingRequest):
    # text, token ids, or a batch of either: each prompt's choices in turn, indexed prompt after prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the likeliest ids per token
    echo: bool | None = False  # the prompt before the completion, and its tokens' log-probabilities
    # 0 with echo scores a text without decoding (how evaluation harnesses read log-likelihoods)
    max_tokens: int | None = Field(default=None, ge=0)
    # fill in the middle: the text after the gap, the prompt being the text before it ("" asks for nothing)
    suffix: str | None = None

    @model_validator(mode="after")
    def _nothing_only_with_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 decodes nothing; it is for scoring a prompt with echo: true")
        return self

    @model_validator(mode="after")
    def _suffix_after_text(self) -> "CompletionRequest":
        if self.suffix and not all(isinstance(prompt, str) for prompt in self.prompts):
            raise ValueError("a suffix fills in the middle after a text prompt; send the prompt as text")
        if self.suffix and self.echo:
            raise ValueError("echo and suffix cannot be used together")
        return self

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, logprobs):
        # some clients send chat's boolean here: false asks for nothing, true is not a count
        if logprobs is False:
            return None
        if logprobs is True:
            raise ValueError("logprobs takes the number of likeliest ids per token (0 to "
                             f"{MAX_TOP_LOGPROBS}) on /v1/completions, not true")
        return logprobs

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: its one prompt, or a batch's in order."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]

    @model_validator(mode="after")
    def _completions_within_bounds(self) -> "CompletionRequest":
        wanted = len(self.prompts) * (self.n or 1)
        if wanted > MAX_CHOICES:
            raise ValueError(f"a request asks for at most {MAX_CHOICES} completions (n × the prompts of a batch), "
                             f"got {wanted}")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: none
    strict: bool | None = None  # a call that the request forces always satisfies the schema


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            raise ValueError("a tool call's arguments must be a JSON object written as a string") from None
        if not isinstance(value, dict):
            raise ValueError("a tool call's arguments must be a JSON object written as a string")
        return arguments


class MessageToolCall(BaseModel):
    """A call an earlier answer made, sent back in the conversation."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        # templates write the arguments with tojson, so they take the object, not its text
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: role, plain-text content, and an
        assistant's calls or the call a tool's answer belongs to."""
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for system
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"only text content is supported, got a {part.type!r} part")
        return "".join(part.text or "" for part in self.content)


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(DecodingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None  # functions the model may call (verispec.server.tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto"
    parallel_tool_calls: bool | None = None  # None: true; false: an answer makes one call at most

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "ChatCompletionRequest":
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: two functions are named {next(n for n in names if names.count(n) > 1)!r}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools to call")
        if self.forced_calls and (self.response_format and self.response_format.type != "text"
                                  or self.guided_regex is not None or self.guided_grammar is not None):
            raise ValueError("a tool_choice that forces calls holds the answer to them; leave out "
                             "response_format, guided_regex and guided_grammar")
        return self

    @property
    def offered_tools(self) -> list[Tool]:
        """The tools the prompt offers: none where tool_choice is "none"."""
        return [] if self.tool_choice == "none" else list(self.tools or ())

    @property
    def forced_calls(self) -> list[Tool]:
        """The tools among which the answer must call (one named, or any with "required");
        empty where the model decides."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return [tool for tool in self.tools or () if tool.function.name == choice.function.name]
        return list(self.tools or ()) if choice == "required" else []

    @model_validator(mode="after")
    def _text_only(self) -> "ChatCompletionRequest":
        for message in self.messages:
            message.text()  # raises for image or audio parts
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
