"""An OpenAI-compatible HTTP API over one model, decoded plainly or speculatively.

Every request runs `verispec.generate.stream` once per choice (and per prompt of a
batch of prompts), one request at a time (batch 1): the model sits behind a lock, and
decoding runs in a worker thread so that the event loop keeps answering /health and
/metrics meanwhile. Prompts are encoded and checked before a request queues for the model,
so a user's mistake is a 400 with OpenAI's error body, never a 500 or a half-sent stream.

Any model name in a request is accepted: the server has one model, and the
responses name it (the name `GET /v1/models` lists). Tool calls are read out of a chat
answer's text (`verispec.server.tools`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.errors import ContextOverflowError, VerispecError
from verispec.events import Event, Finished, GenerationResult, Logprob, Prompt, Token
from verispec.generate import MAX_GAMMA, encode_prompt, make_proposer, stream
from verispec.sampling import SEED_MAX
from verispec.server.metrics import ServerMetrics
from verispec.server.responses import FINISH_REASONS, Echo, LogprobsShape, ResponseShape, error_body, sse
from verispec.server.schemas import EXPECTED_SHAPES, ChatCompletionRequest, CompletionRequest, DecodingRequest
from verispec.server.tools import CallHolder, calls_grammar, template_calls_tools
from verispec.structured import request_structure

log = logging.getLogger("verispec.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the end of the context
ADAPTIVE_POLICIES = (False, "cost", "heuristic")


@dataclass
class Job:
    """A checked request: prompt token ids and the options for `stream`."""

    prompt_ids: list[int]
    options: dict[str, Any]
    prompt: str | None = None  # what stream() reads in the ids' place: the text before a suffix's gap
    echo: Echo | None = None  # the prompt, to answer before the completion
    choices: int = 1  # completions of the prompt, decoded one after another
    tool_names: set[str] | None = None  # the functions an answer may call, read out of its text
    single_call: bool = False  # parallel calls off: an answer ends with its first call

    @property
    def stream_prompt(self) -> str | list[int]:
        return self.prompt if self.prompt is not None else self.prompt_ids

    def choice_options(self, index: int) -> dict[str, Any]:
        """The options of choice `index`: with a seed, choices take consecutive seeds (wrapping
        within the 64 bits a seed may have), so that they differ from each other and repeat."""
        seed = self.options.get("seed")
        if index == 0 or seed is None:
            return self.options
        seed += index
        return {**self.options, "seed": seed if seed <= SEED_MAX else seed - 2**64}


class Engine:
    """The served model, its drafting method, and the lock that keeps requests one at a time."""

    def __init__(self, target, draft=None, gamma: int = 4, adaptive: bool | str = False,
                 ngram: tuple[int, int] = (3, 1), served_model_name: str | None = None,
                 draft_vocab: int | str | None = "auto", lookup: bool = True):
        if not 0 <= gamma <= MAX_GAMMA:
            raise VerispecError(f"gamma must be between 0 and {MAX_GAMMA}, got {gamma}")
        adaptive = "cost" if adaptive is True else adaptive
        if adaptive not in ADAPTIVE_POLICIES:
            raise VerispecError(f"adaptive must be one of false, 'cost' or 'heuristic', got {adaptive!r}")
        self.target = target
        self.name = served_model_name or target.name
        # built once, so a draft whose tokenizer differs from the target's fails at start-up
        self.proposer = make_proposer(draft, target, ngram, draft_vocab)
        self.draft_name = getattr(self.proposer, "name", None) if self.proposer is not None else None
        self.gamma, self.adaptive, self.lookup = gamma, adaptive, lookup
        self.context_size = target.config.max_position_embeddings
        self.created = int(time.time())
        self.lock = asyncio.Lock()
        positions = (max(gamma, 16) if adaptive else gamma) if self.proposer is not None else 0
        self.metrics = ServerMetrics(self.name, positions)

    # -- checking a request
    def completion_jobs(self, request: CompletionRequest) -> list[Job]:
        """One job per prompt: the request's prompt, or each of a batch's, all checked before
        any of them queues (a mistake in one prompt names its place in the batch)."""
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
        options = self._options(request, max_tokens)
        if request.suffix:  # stream() frames the gap, and ends the text where a middle ends
            options["suffix"] = request.suffix
        if request.echo:
            options["prompt_logprobs"] = request.logprobs
        prompts = request.prompts
        jobs = []
        for index, prompt in enumerate(prompts):
            try:
                jobs.append(self._completion_job(prompt, request, options))
            except VerispecError as exc:
                if len(prompts) == 1:
                    raise
                raise type(exc)(f"prompt {index} of the batch: {exc}") from None
        return jobs

    def _completion_job(self, prompt: str | list[int], request: CompletionRequest, options: dict[str, Any]) -> Job:
        """The job of one of the request's prompts."""
        suffix = request.suffix or None
        if suffix is not None:  # the ids stream() reads; may raise InfillError
            prompt_ids = encode_prompt(self.target.tokenizer, prompt, False, suffix)
        elif isinstance(prompt, str):
            prompt_ids = self.target.tokenizer.encode(prompt)
        else:
            prompt_ids = self._checked_ids(prompt)
        job = Job(self._checked_prompt(prompt_ids), dict(options), choices=request.n or 1)
        if suffix is not None:
            job.prompt = prompt
        if request.echo:  # ids are echoed with their special tokens, as their log-probabilities list them
            tokenizer = self.target.tokenizer
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special_tokens=False)
            job.echo = Echo(text, prompt_ids)
        return job

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        tokenizer = self.target.tokenizer
        if not tokenizer.chat_template:
            raise VerispecError(f"{self.name} has no chat template; use /v1/completions with a plain prompt")
        max_tokens = request.max_completion_tokens or request.max_tokens or self.context_size
        tools = request.offered_tools
        if tools and not template_calls_tools(tokenizer.chat_template):
            raise VerispecError(f"{self.name}'s chat template does not offer tools in the <tool_call> form this "
                                f"server reads; leave out tools")
        options = self._options(request, max_tokens, self._calls_grammar(request))
        messages = [m.for_template() for m in request.messages]
        prompt_ids = tokenizer.encode_chat(messages, [t.for_template() for t in tools])  # may raise ChatTemplateError
        names = {tool.function.name for tool in tools} if tools else None
        return Job(self._checked_prompt(prompt_ids), options, choices=request.n or 1, tool_names=names,
                   single_call=request.parallel_tool_calls is False)

    def _calls_grammar(self, request: ChatCompletionRequest) -> str | None:
        """The grammar that holds an answer to calls, where the request forces them."""
        forced = request.forced_calls
        if not forced:
            return None
        several = request.parallel_tool_calls is not False and request.tool_choice == "required"
        return calls_grammar([t.function.model_dump(exclude_none=True) for t in forced], several)

    def _checked_ids(self, ids: list[int]) -> list[int]:
        vocab = self.target.config.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise VerispecError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")
        return ids

    def _checked_prompt(self, prompt_ids: list[int]) -> list[int]:
        """A prompt's ids, once they are known to leave room in the context."""
        if not prompt_ids:
            raise VerispecError("the prompt is empty")
        if len(prompt_ids) >= self.context_size:
            raise ContextOverflowError(
                f"this model's maximum context length is {self.context_size} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens; shorten the prompt")
        return prompt_ids

    def _options(self, request: DecodingRequest, max_tokens: int, calls: str | None = None) -> dict[str, Any]:
        """stream()'s options for the request, whatever its prompts, checked once; `calls`: the
        grammar of the tool calls it forces."""
        grammar = calls or request.guided_grammar
        self._checked_ids([*(request.logit_bias or ()), *(request.stop_token_ids or ())])
        if (request.min_tokens or 0) > max_tokens:
            raise VerispecError(f"min_tokens ({request.min_tokens}) is more than max_tokens ({max_tokens})")
        json_schema = request.response_format.wanted_schema if request.response_format else None
        # compiled here too, so that a bad structure is refused before queueing
        request_structure(json_schema, request.guided_regex, self.target.tokenizer, self.target.config.vocab_size,
                          request.ignore_eos, request.min_tokens or 0, grammar)
        return dict(
            max_tokens=max_tokens,  # stream() trims it to what the context has room for
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=max(request.top_k or 0, 0),
            seed=request.seed,
            stop=request.stop_strings,
            stop_token_ids=request.stop_token_ids or (),
            min_tokens=request.min_tokens or 0,
            ignore_eos=request.ignore_eos,
            draft=self.proposer,
            gamma=self.gamma,
            adaptive=self.adaptive,
            lookup=self.lookup,
            logprobs=request.alternatives,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=request.logit_bias,
            json_schema=json_schema,
            regex=request.guided_regex,
            grammar=grammar,
        )

    # -- decoding
    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Wait for the model, then hold it."""
        self.metrics.waiting.inc()
        try:
            await self.lock.acquire()
        finally:
            self.metrics.waiting.dec()
        self.metrics.running.inc()
        try:
            yield
        finally:
            self.metrics.running.dec()
            self.lock.release()

    async def complete(self, jobs: list[Job]) -> list[GenerationResult]:
        """Every choice's result, prompt after prompt, in order."""
        async with self.turn():
            return [await anyio.to_thread.run_sync(self._run_to_end, job, index)
                    for job in jobs for index in range(job.choices)]

    def _run_to_end(self, job: Job, index: int) -> GenerationResult:
        for event in stream(self.target, job.stream_prompt, **job.choice_options(index)):
            if isinstance(event, Finished):
                self._record(event.result)
                return event.result
        raise AssertionError("stream ended without a Finished event")

    async def events(self, jobs: list[Job]) -> AsyncIterator[tuple[int, Event]]:
        """The events of one request, each with its choice's index, choice after choice and
        prompt after prompt; the model is held until the last one (or the client leaves)."""
        async with self.turn():
            choices = [(job, index) for job in jobs for index in range(job.choices)]
            for flat, (job, index) in enumerate(choices):
                events = stream(self.target, job.stream_prompt, **job.choice_options(index))
                finished, generated = False, 0
                try:
                    while (event := await anyio.to_thread.run_sync(next, events, None)) is not None:
                        if isinstance(event, Finished):
                            finished = True
                            self._record(event.result)
                        elif isinstance(event, Token):
                            generated += 1
                        yield flat, event
                finally:
                    events.close()
                    if not finished:
                        self.metrics.record_abort(len(job.prompt_ids), generated)

    def _record(self, result: GenerationResult) -> None:
        self.metrics.record(result, FINISH_REASONS[result.finish_reason])


def create_app(target, draft=None, gamma: int = 4, adaptive: bool | str = False,
               ngram: tuple[int, int] = (3, 1), served_model_name: str | None = None,
               draft_vocab: int | str | None = "auto", lookup: bool = True) -> FastAPI:
    """A FastAPI app serving `target` (a LoadedModel), speculatively when `draft` is given.

    `draft`: None, a LoadedModel with the target's tokenizer, "ngram" (prompt lookup), or a
    Proposer. Raises VerispecError at once for a draft whose tokenizer differs from the target's.
    """
    from verispec import __version__

    engine = Engine(target, draft, gamma, adaptive, ngram, served_model_name, draft_vocab, lookup)
    # strict_content_type=False: a JSON body sent without a Content-Type header is still read as JSON
    app = FastAPI(title="verispec", version=__version__, strict_content_type=False,
                  description="OpenAI-compatible API over speculative decoding that never changes the answer.")
    app.state.engine = engine
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.name, "busy": engine.lock.locked()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.name, "object": "model", "created": engine.created, "owned_by": "verispec",
                "max_model_len": engine.context_size,
                "verispec": {"draft": engine.draft_name, "gamma": engine.gamma, "adaptive": engine.adaptive,
                             "weights": getattr(target, "weights", None),
                             "kv_cache": getattr(target, "kv_cache", None)}}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = engine.metrics.exposition(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Response:
        return await _answer(engine, engine.completion_jobs(request), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        return await _answer(engine, [engine.chat_job(request)], request, chat=True)

    return app


async def _answer(engine: Engine, jobs: list[Job], request: DecodingRequest, chat: bool) -> Response:
    choices = [job for job in jobs for _ in range(job.choices)]  # the job of each choice, in order
    logprobs = None
    if request.alternatives is not None:  # one per choice: each keeps its own text offsets
        logprobs = [LogprobsShape(engine.target.tokenizer, chat) for _ in choices]
    shape = ResponseShape(engine.name, chat, engine.draft_name, logprobs, [job.echo for job in choices],
                          per_prompt=jobs[0].choices, tool_names=jobs[0].tool_names,
                          single_call=jobs[0].single_call)
    if request.stream:
        return StreamingResponse(_sse_stream(engine, jobs, shape, request.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(shape.full(await engine.complete(jobs)))


def _opening(shape: ResponseShape, index: int) -> list[str]:
    """What a choice's stream starts with: chat's role, a completion's echoed prompt (which,
    with log-probabilities, waits for the prompt to be scored)."""
    chunks = [sse(shape.chunk("", role=True, index=index))] if shape.chat else []
    echo = shape.echo(index)
    if echo is not None and shape.logprobs is None:
        chunks.append(sse(shape.chunk(echo.text, index=index)))
    return chunks


def _call_holder(shape: ResponseShape) -> CallHolder | None:
    """What holds back a chat choice's text from where a tool call may start, if it may make any."""
    if not shape.chat or shape.tool_names is None:
        return None
    return CallHolder(shape.tool_names, shape.single_call)


async def _sse_stream(engine: Engine, jobs: list[Job], shape: ResponseShape,
                      include_usage: bool) -> AsyncIterator[str]:
    for chunk in _opening(shape, 0):  # sent at once, before the model is free
        yield chunk
    opened, results = 0, []
    unsent: list[tuple[int, Logprob]] = []  # log-probabilities of tokens whose text is not sent yet
    holder = _call_holder(shape)
    try:
        async for index, event in engine.events(jobs):
            if index != opened:
                opened, holder = index, _call_holder(shape)
                for chunk in _opening(shape, index):
                    yield chunk
            if isinstance(event, Prompt):  # echo with log-probabilities: the prompt's come first
                yield sse(shape.chunk(shape.echo(index).text, tokens=list(zip(event.token_ids, event.logprobs)),
                                      index=index))
                continue
            if isinstance(event, Finished):
                tail, calls = holder.finish(event.tail) if holder is not None else (event.tail, [])
                if calls:  # the text before them, then the calls, then the end
                    if tail:
                        yield sse(shape.chunk(tail, tokens=unsent, index=index))
                        unsent = []
                    yield sse(shape.calls_chunk(calls, index))
                    tail = ""
                yield sse(shape.final_chunk(event.result, tail, unsent, index=index, called=bool(calls)))
                unsent = []
                results.append(event.result)
                continue
            if event.logprob is not None:
                unsent.append((event.token_id, event.logprob))
            text = holder.feed(event.text) if holder is not None else event.text
            if text:  # a token whose text is still incomplete (or may open a tool call) sends nothing yet
                yield sse(shape.chunk(text, tokens=unsent, index=index))
                unsent = []
        if include_usage:
            yield sse(shape.usage_chunk(results))
    except VerispecError as exc:  # the status line is already sent: report it in the stream
        yield sse(error_body(str(exc), 400))
    except Exception as exc:  # a bug: log it here, and tell the client in one line
        log.exception("error while streaming")
        yield sse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500))
    yield sse("[DONE]")


# ---------------------------------------------------------------- errors


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, code), status_code=status)


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's first complaint, and the top-level field it concerns."""
    first = errors[0]
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error")
        return "the request body is not valid JSON" + (f" ({detail})" if detail else ""), None
    path = _field_path(first)
    param = str(path[0]) if path else None
    where = ".".join(str(part) for part in path)
    if kind == "missing":
        return (f"missing required field '{where}'" if path else "the request needs a JSON object body"), param
    if not path and kind == "model_attributes_type":
        if isinstance(first.get("input"), (bytes, str)):
            return "the request body must be a JSON object sent with Content-Type: application/json", None
        return "the request body must be a JSON object", None
    if _is_union_member(first):  # every member of a union failed: name the shapes accepted
        expected = EXPECTED_SHAPES.get(str(path[-1]))
        if expected:
            return f"{where} must be {expected}", param
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return (f"{where}: {message}" if path else message), param


def _field_path(error: dict[str, Any]) -> list[str | int]:
    """The error's location without the leading 'body' and without pydantic's union member tags."""
    return [part for part in error.get("loc", ())[1:] if not _is_union_tag(part)]


def _is_union_tag(part: str | int) -> bool:
    # pydantic names the union member it tried: 'str', 'list[int]', 'function-after[...]', 'none'
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def _is_union_member(error: dict[str, Any]) -> bool:
    return any(_is_union_tag(part) for part in error.get("loc", ()))


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(list(exc.errors()))
        return _error(400, message, param)

    @app.exception_handler(ContextOverflowError)
    async def too_long(request: Request, exc: ContextOverflowError) -> JSONResponse:
        return _error(400, str(exc), "prompt", "context_length_exceeded")

    @app.exception_handler(VerispecError)
    async def user_mistake(request: Request, exc: VerispecError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (f"no such endpoint: {request.method} {request.url.path}; this server has GET /v1/models, "
                       f"POST /v1/completions, POST /v1/chat/completions, GET /health and GET /metrics")
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return _error(exc.status_code, message)

    @app.exception_handler(MemoryError)
    async def out_of_memory(request: Request, exc: MemoryError) -> JSONResponse:
        return _error(503, "out of memory while decoding; try a shorter prompt or max_tokens")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:  # a bug, not the user's doing
        log.exception("error while answering %s %s", request.method, request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")
