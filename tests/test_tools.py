"""Tool calls on the chat API: reading calls out of an answer, holding a streamed answer back
where a call may start, and answers held to calls by tool_choice, plainly and speculatively."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from test_server import MESSAGES, assert_error, byte_tokenizer, sse_payloads, tiny_model
from test_server import client, spec_client  # noqa: F401  (fixtures over this module's target)
from verispec.generate import generate
from verispec.server import create_app
from verispec.server.tools import CallHolder, calls_grammar, parse_tool_calls
from verispec.structured import Structure, matcher_tokenizer

# a Hermes-style template in brief: the tools' names, and an assistant's calls as Qwen2.5's writes them
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "\nanswer <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIGIT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "description": "one digit", "parameters": DIGIT}},
         {"type": "function", "function": {"name": "go", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}]
NAMES = {"f", "go"}
CONTEXT = 256


def tools_tokenizer(template: str = TOOLS_TEMPLATE):
    """The byte tokenizer with the tags as tokens of their own that are not special, as Qwen2.5 has them."""
    from tokenizers import AddedToken

    tokenizer = byte_tokenizer(chat_template=template)
    tokenizer.backend.add_tokens([AddedToken(tag, special=False, normalized=False)
                                  for tag in ("<tool_call>", "</tool_call>")])
    return tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_model(tools_tokenizer(), context=CONTEXT)


def ask(server: TestClient, **fields):
    return server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80, "temperature": 0,
                                                     "tools": TOOLS, **fields})


def calls_of(body: dict) -> list[tuple[str, dict]]:
    message = body["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


# ---------------------------------------------------------------- reading calls


def test_calls_are_read_out_of_an_answer():
    text = ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "go", "arguments": "{}"}</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me look."
    assert parse_tool_calls(text + " Done. ", NAMES)[0] == "Let me look.\nDone."
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 3}'), ("go", "{}")]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    body = calls[0].body(index=0)
    assert body == {"index": 0, "id": calls[0].id, "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 3}'}}


@pytest.mark.parametrize("text", [
    "no calls here ",
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the tools
    '<tool_call>{"name": "f", "arguments": {"x": </tool_call>',  # not JSON
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # never closed
])
def test_what_is_not_a_call_stays_the_answers_text(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("text,called", [
    ('```json\n{\n  "name": "f",\n  "arguments": {"x": 2}\n}\n```', True),  # as Qwen2.5-Coder 1.5B answers
    (' {"name": "f", "arguments": {"x": 2}}\n', True),
    ('```python\n{"name": "f", "arguments": {"x": 2}}\n```', False),  # code, not a call
    ('Call it: {"name": "f", "arguments": {"x": 2}}', False),  # not the whole answer
    ('```json\n{"name": "h", "arguments": {"x": 2}}\n```', False),  # not one of the tools
])
def test_an_answer_that_is_one_call_without_the_tags_is_that_call(text, called):
    content, calls = parse_tool_calls(text, NAMES)
    assert ([(c.name, json.loads(c.arguments)) for c in calls], content) == (
        ([("f", {"x": 2})], None) if called else ([], text))
    assert parse_tool_calls(text, NAMES, bare=False) == (text, [])
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # streamed, the same
    holder = CallHolder(NAMES)
    sent = "".join(holder.feed(piece) for piece in pieces)
    rest, streamed = holder.finish("")
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert sent + rest == (content or "")


def test_a_streamed_answer_waits_only_while_it_may_be_a_bare_call():
    holder = CallHolder(NAMES)
    assert [holder.feed(p) for p in ("\n", "``", "`py", "thon\nx = 1\n")] == ["", "", "\n```py", "thon\nx = 1"]
    holder = CallHolder(NAMES)
    assert [holder.feed(p) for p in ("Sure", ' {"name": "f"')] == ["Sure", ' {"name": "f"']
    assert holder.finish(', "arguments": {}}') == (', "arguments": {}}', [])  # text came first: no bare call


def test_only_calls_is_no_content():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "go", "arguments": {}}\n</tool_call>\n', NAMES)
    assert content is None and [c.name for c in calls] == ["go"]


@pytest.mark.parametrize("pieces", [
    ["Sure", ". <", "tool", "_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"],
    ["Sure. ", "<tool_call>", "\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}", "\n</tool_call>"],
    ["a <b> c <", "too", "l_c", "all>", '{"name": "f", "arguments": {"x": 1}}</tool_call> after'],
    [" lead ", " ", "<tool_call>", '{"name": "f", "arguments": {}}</tool_call>', "<tool_call>{}</tool_call>"],
    ["", "\n", '<tool_call>{"name": "go", "arguments": {}}</tool_call>\n', "then\n"],
])
def test_a_streamed_answer_is_held_from_where_a_call_may_start(pieces):
    holder = CallHolder(NAMES)
    sent = [holder.feed(piece) for piece in pieces[:-1]]
    rest, calls = holder.finish(pieces[-1])
    assert not any("<tool" in s or s.endswith("<") for s in sent)
    whole = "".join(pieces)
    content, expected = parse_tool_calls(whole, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]
    assert "".join(sent) + rest == content


TWO_CALLS = ('Both. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and '
             '<tool_call>{"name": "go", "arguments": {}}</tool_call> done')


def test_an_answer_without_parallel_calls_ends_with_its_first_call():
    assert [c.name for c in parse_tool_calls(TWO_CALLS, NAMES)[1]] == ["f", "go"]
    content, calls = parse_tool_calls(TWO_CALLS, NAMES, single=True)
    assert content == "Both." and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    # a block that is not a call does not count as the first
    skipped = '<tool_call>{"name": "h"}</tool_call> ' + TWO_CALLS
    assert [c.name for c in parse_tool_calls(skipped, NAMES, single=True)[1]] == ["f"]
    for size in (1, 4, 11):  # streamed, the same
        holder = CallHolder(NAMES, single=True)
        sent = "".join(holder.feed(TWO_CALLS[i:i + size]) for i in range(0, len(TWO_CALLS), size))
        rest, streamed = holder.finish("")
        assert (sent + rest, [c.arguments for c in streamed]) == (content, ['{"x": 1}'])


def test_a_streamed_answer_without_calls_is_sent_whole():
    holder = CallHolder(NAMES)
    pieces = [" x < y", " and <", "tool", "_cal", "l> here", " "]
    sent = [holder.feed(piece) for piece in pieces]
    rest, calls = holder.finish("")
    assert calls == [] and "".join(sent) + rest == "".join(pieces)
    # what may open a call, or stand before one, waits; from a tag on, everything does
    assert sent == [" x < y", " and", "", "", "", ""] and rest == " <tool_call> here "


def test_the_calls_grammar_admits_calls_of_the_tools_alone():
    """Calls as the template writes them pass; another function, argument or value does not,
    nor a second call where one is asked for. The tags may be the tokenizer's own tokens."""
    from llguidance import LLMatcher

    tokenizer = tools_tokenizer()
    tags = [tokenizer.vocab[tag] for tag in ("<tool_call>", "</tool_call>")]
    one = '<tool_call>\n{"name": "f", "arguments": {"x": 7}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "go", "arguments": {}}\n</tool_call>'
    for several in (False, True):
        grammar = Structure.lark(calls_grammar([tool["function"] for tool in TOOLS], several)).grammar
        for text, admitted in ((one, True), (two, several), (one.replace("7", "77"), False),
                               (one.replace('"f"', '"h"'), False), (one.replace('"x"', '"y"'), False),
                               (one.replace(": ", ":"), False)):
            matcher = LLMatcher(matcher_tokenizer(tokenizer, tokenizer.vocab_size), grammar, log_level=0)
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert ids[0] == tags[0]
            assert (matcher.consume_tokens(ids) and matcher.is_accepting()) == admitted, (text, several)


def test_an_added_token_that_decoding_keeps_is_text_to_a_structure():
    """<tool_call> (added, not special) may spell its text where a structure asks for it, and the
    matcher takes it; it was a special token to llguidance, which the mask let through and the
    matcher then refused."""
    from verispec.structured import StructureState

    tokenizer = tools_tokenizer()
    tag = tokenizer.vocab["<tool_call>"]
    assert tag not in tokenizer.hidden_ids and tokenizer.vocab["<|im_end|>"] in tokenizer.hidden_ids
    state = StructureState(Structure.regex("<tool_call>x"), tokenizer, tokenizer.vocab_size)
    assert state.allowed()[0][tag] and state.matcher.validate_tokens([tag]) == 1
    state.add([tag])
    assert state.allowed()[0].nonzero().flatten().tolist() == tokenizer.encode("x", add_special_tokens=False)


# ---------------------------------------------------------------- the server


def test_a_named_tool_choice_holds_the_answer_to_one_call(client, spec_client, target):
    """Even a random model calls the named function, its arguments within the schema; the
    speculative answer is the plain one."""
    choice = {"type": "function", "function": {"name": "f"}}
    bodies = [ask(server, tool_choice=choice).json() for server in (client, spec_client)]
    for body in bodies:
        [call] = calls_of(body)
        assert call[0] == "f" and call[1]["x"] in range(10)
        message = body["choices"][0]["message"]
        assert message["content"] is None and message["tool_calls"][0]["type"] == "function"
        assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert calls_of(bodies[0]) == calls_of(bodies[1])
    assert bodies[1]["verispec"]["drafted"] > 0
    # the same answer as stream() held to the same grammar gives
    grammar = calls_grammar([TOOLS[0]["function"]], False)
    prompt = target.tokenizer.render_chat(MESSAGES, tools=TOOLS)
    expected = generate(target, prompt, max_tokens=80, grammar=grammar).text
    assert parse_tool_calls(expected, NAMES)[1][0].arguments == bodies[0]["choices"][0]["message"]["tool_calls"][0][
        "function"]["arguments"]


def test_required_calls_one_or_more_of_the_tools(client, spec_client):
    for parallel in (True, False):
        bodies = [ask(server, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120).json()
                  for server in (client, spec_client)]
        calls = calls_of(bodies[0])
        assert calls and all(name in NAMES for name, _ in calls)
        assert len(calls) == 1 or parallel
        assert calls_of(bodies[1]) == calls
        assert bodies[0]["choices"][0]["finish_reason"] == "tool_calls"


CALLING = r'Sure\.\n<tool_call>\n\{"name": "f", "arguments": \{"x": 4\}\}\n</tool_call>'


def test_auto_reads_the_calls_the_model_makes(client, spec_client):
    """guided_regex stands in for a model that chose to call: the call is read, the rest is content."""
    for server in (client, spec_client):
        body = ask(server, guided_regex=CALLING).json()
        assert calls_of(body) == [("f", {"x": 4})]
        assert body["choices"][0]["message"]["content"] == "Sure."
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        # without tools the same text is the answer's content
        plain = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 80,
                                                          "guided_regex": CALLING}).json()
        assert "tool_calls" not in plain["choices"][0]["message"]
        assert plain["choices"][0]["message"]["content"].endswith("</tool_call>")


def test_parallel_calls_off_keeps_an_answers_first_call(client):
    two = CALLING + r' <tool_call>\{"name": "go", "arguments": \{\}\}</tool_call>'
    assert [name for name, _ in calls_of(ask(client, guided_regex=two, max_tokens=120).json())] == ["f", "go"]
    body = ask(client, guided_regex=two, parallel_tool_calls=False, max_tokens=120).json()
    assert calls_of(body) == [("f", {"x": 4})] and body["choices"][0]["message"]["content"] == "Sure."
    chunks = sse_payloads(ask(client, guided_regex=two, parallel_tool_calls=False, stream=True, max_tokens=120))[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["f"]


def test_auto_reads_an_answer_that_is_one_call_without_the_tags(client, spec_client):
    fenced = r'```json\n\{"name": "f", "arguments": \{"x": 5\}\}\n```'
    for server in (client, spec_client):
        body = ask(server, guided_regex=fenced).json()
        assert calls_of(body) == [("f", {"x": 5})] and body["choices"][0]["message"]["content"] is None
        chunks = sse_payloads(ask(server, guided_regex=fenced, stream=True))[:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not any(d.get("content") for d in deltas)
        assert [json.loads(c["function"]["arguments"]) for d in deltas for c in d.get("tool_calls", [])] == [{"x": 5}]


def test_streamed_calls_come_whole_after_the_text_before_them(spec_client):
    """The streamed text adds up to the whole answer's content, the calls come in one delta."""
    for fields, content in (({"guided_regex": CALLING}, "Sure."),
                            ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, None)):
        whole = ask(spec_client, **fields).json()
        assert whole["choices"][0]["message"]["content"] == content
        chunks = sse_payloads(ask(spec_client, stream=True, **fields))[:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == (content or "")
        [with_calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in with_calls] == [
            (i, name, arguments) for i, (name, arguments) in enumerate(calls_of(whole))]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_tools_out(client):
    with_tools = ask(client, max_tokens=4).json()["usage"]["prompt_tokens"]
    none = ask(client, max_tokens=4, tool_choice="none").json()["usage"]["prompt_tokens"]
    without = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}).json()
    assert none == without["usage"]["prompt_tokens"] < with_tools


def test_earlier_calls_and_their_results_go_back_to_the_template(client, target):
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    engine = client.app.state.engine
    from verispec.server.schemas import ChatCompletionRequest

    job = engine.chat_job(ChatCompletionRequest(messages=messages, tools=TOOLS))
    text = target.tokenizer.decode(job.prompt_ids, skip_special_tokens=False)
    # the arguments as an object, as the template's tojson expects, not as a string of JSON
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>' in text
    assert "<|im_start|>tool\n4<|im_end|>" in text
    assert client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS,
                                                     "max_tokens": 3}).status_code == 200


@pytest.mark.parametrize("fields,fragments", [
    ({"tool_choice": {"type": "function", "function": {"name": "h"}}}, ["'h'", "not among the tools"]),
    ({"tools": [], "tool_choice": "required"}, ["needs tools"]),
    ({"tools": [TOOLS[0], TOOLS[0]]}, ["two functions are named 'f'"]),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, ["leave out response_format"]),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, ["name"]),
    ({"tools": [{"type": "retrieval"}]}, ["tools"]),
    ({"functions": [{"name": "f"}]}, ["functions", "not supported"]),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     ["arguments must be a JSON object"]),
])
def test_bad_tool_requests_are_clear_400s(client, fields, fragments):
    assert_error(ask(client, **fields), 400, *fragments)


def test_tools_need_a_template_that_calls_them():
    plain = TestClient(create_app(tiny_model(byte_tokenizer(), context=CONTEXT)))
    assert_error(ask(plain), 400, "does not offer tools", "leave out tools")
    assert ask(plain, tool_choice="none", max_tokens=2).status_code == 200
    assert_error(plain.post("/v1/completions", json={"prompt": "x", "tools": TOOLS}), 400, "tools", "not supported")


def test_tool_calls_stream_with_a_usage_chunk(client):
    chunks = sse_payloads(ask(client, stream=True, tool_choice="required", stream_options={"include_usage": True}))
    whole = ask(client, tool_choice="required").json()
    assert chunks[-2]["usage"] == whole["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]][-1] == "tool_calls"
