"""The OpenAI-compatible server on a tiny random model: answers equal `generate`, metrics, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from verispec.config import ModelConfig
from verispec.errors import TokenizerMismatchError, VerispecError
from verispec.generate import generate
from verispec.loading import LoadedModel
from verispec.loading.tokenizer import Tokenizer
from verispec.models.dense import CausalLM
from verispec.server import create_app

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT = 96
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def byte_tokenizer(extra_merge: tuple[str, str] | None = None, chat_template: str | None = CHAT_TEMPLATE,
                   specials: list[str] = SPECIALS) -> Tokenizer:
    """Byte-level BPE: the 256 bytes, optionally one merge, then the special tokens (three)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [extra_merge] if extra_merge else []
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos_id = backend.token_to_id("<|im_end|>")
    return Tokenizer(backend, {eos_id}, eos_token="<|im_end|>", chat_template=chat_template)


def tiny_model(tokenizer: Tokenizer, seed: int = 0, name: str = "tiny", context: int = CONTEXT) -> LoadedModel:
    """A two-layer Qwen2-shaped model with large random weights (clear argmax winners, few near-ties)."""
    config = ModelConfig(model_type="qwen2", vocab_size=tokenizer.vocab_size, hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=context, attention_bias=True,
                         eos_token_id=sorted(tokenizer.eos_ids))
    torch.manual_seed(seed)
    model = CausalLM(config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" not in param_name:
                param.normal_(0.0, 0.2)
    model.eval().requires_grad_(False)
    return LoadedModel(name, Path(name), model, tokenizer, config, 0.0, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_model(byte_tokenizer())


@pytest.fixture(scope="module")
def client(target) -> TestClient:
    return TestClient(create_app(target))


@pytest.fixture(scope="module")
def spec_client(target) -> TestClient:
    """Speculative serving with the target as its own draft: every draft is kept."""
    return TestClient(create_app(target, draft=target, gamma=3))


def sse_payloads(response) -> list:
    """The `data:` payloads of a server-sent event stream, [DONE] as the string."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [line[len("data: "):] for line in lines]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]] + ["[DONE]"]


def metric(client: TestClient, name: str, **labels: str) -> float:
    """The value of one sample of /metrics, found by name and labels (model_name may be left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            sample_labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            if sample.name == name and sample_labels == labels:
                return sample.value
    raise AssertionError(f"no sample {name} {labels} in /metrics")


# ---------------------------------------------------------------- answers


def test_completion_equals_generate(client, target):
    expected = generate(target, PROMPT, max_tokens=12, temperature=0)
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 12,
                                                    "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["model"] == "tiny"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert body["usage"] == {"prompt_tokens": expected.prompt_tokens,
                             "completion_tokens": len(expected.token_ids),
                             "total_tokens": expected.prompt_tokens + len(expected.token_ids)}
    assert body["usage"]["prompt_tokens"] == len(target.tokenizer.encode(PROMPT))
    assert body["verispec"]["draft"] is None


def test_token_id_prompt_equals_text_prompt(client, target):
    ids = target.tokenizer.encode(PROMPT)
    by_text = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0}).json()
    batch_of_one = client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 8, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] == batch_of_one["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]


def test_any_model_name_is_accepted_and_the_served_name_answers(client):
    body = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 2}).json()
    assert body["model"] == "tiny"


def test_completion_stream_pieces_add_up(client, target):
    expected = generate(target, PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                    "stream": True, "ignore_eos": True,
                                                    "stream_options": {"include_usage": True}})
    payloads = sse_payloads(response)
    chunks, usage_chunk = payloads[:-2], payloads[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 16 == len(expected.token_ids)


def test_stop_string_ends_the_text_before_it(client, target):
    full = generate(target, PROMPT, max_tokens=16, temperature=0, ignore_eos=True).text
    stop = full[5:7]
    at = full.find(stop)
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                        "stop": [stop], "stream": stream, "ignore_eos": True})
        if stream:
            chunks = sse_payloads(response)[:-1]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]
        assert text == full[:at]
        assert reason == "stop"


def test_chat_equals_generate_with_the_template(client, target):
    expected = generate(target, MESSAGES, max_tokens=10, temperature=0)
    body = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 10,
                                                     "temperature": 0}).json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["prompt_tokens"] == expected.prompt_tokens == len(target.tokenizer.encode_chat(MESSAGES))


def test_chat_text_parts_and_developer_role(client, target):
    plain = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 0})
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    with_parts = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 6, "temperature": 0})
    assert with_parts.json()["choices"] == plain.json()["choices"]


def test_chat_stream_deltas(client, target):
    expected = generate(target, MESSAGES, max_tokens=12, temperature=0, ignore_eos=True)
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12, "temperature": 0,
                                                         "stream": True, "ignore_eos": True})
    chunks = sse_payloads(response)[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    stats = chunks[-1]["verispec"]
    assert stats["decode_s"] > 0 and stats["tokens_per_s"] > 0
    # the rate counts the 11 tokens after the first; decode_s is rounded to 4 places, tokens_per_s to 2
    slowest, fastest = 11 / (stats["decode_s"] + 5e-5), 11 / max(stats["decode_s"] - 5e-5, 1e-9)
    assert slowest - 0.005 <= stats["tokens_per_s"] <= fastest + 0.005


def test_chat_logprobs_are_generates_with_each_tokens_bytes(client, target):
    expected = generate(target, MESSAGES, max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    request = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": True,
               "top_logprobs": 2}
    [choice] = client.post("/v1/chat/completions", json=request).json()["choices"]
    content = choice["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == [lp.logprob for lp in expected.logprobs]
    joined = bytes(b for entry in content for b in entry["bytes"])
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]
    for entry, token_id, lp in zip(content, expected.token_ids, expected.logprobs, strict=True):
        assert bytes(entry["bytes"]) == target.tokenizer.token_bytes(token_id)
        assert [(a["logprob"], bytes(a["bytes"])) for a in entry["top_logprobs"]] == [
            (v, target.tokenizer.token_bytes(i)) for i, v in lp.top]
    streamed = sse_payloads(client.post("/v1/chat/completions", json={**request, "stream": True}))[:-1]
    pieces = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"] is not None]
    assert [entry for piece in pieces for entry in piece["content"]] == content
    assert streamed[0]["choices"][0]["logprobs"] is None  # the role's chunk carries no token


def test_completion_logprobs_in_the_legacy_shape(client, spec_client, target):
    request = {"prompt": PROMPT, "max_tokens": 14, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    [choice] = client.post("/v1/completions", json=request).json()["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 14
    expected = generate(target, PROMPT, max_tokens=14, temperature=0, ignore_eos=True)
    assert logprobs["tokens"] == [target.tokenizer.token_bytes(i).decode("utf-8", errors="replace")
                                  for i in expected.token_ids]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == value == max(top.values())  # greedy: the token is the likeliest
    streamed = sse_payloads(client.post("/v1/completions", json={**request, "stream": True}))[:-1]
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"] is not None]
    assert {key: [v for part in parts for v in part[key]] for key in logprobs} == logprobs
    [speculative] = spec_client.post("/v1/completions", json=request).json()["choices"]
    assert speculative["logprobs"]["tokens"] == logprobs["tokens"]
    assert speculative["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-5)


def test_echo_scores_the_prompt_as_generate_does(client, target):
    """echo with logprobs: the prompt's tokens first (the first without a log-probability), as
    evaluation harnesses read a text's log-likelihood."""
    request = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True,
               "logprobs": 2}
    [choice] = client.post("/v1/completions", json=request).json()["choices"]
    expected = generate(target, PROMPT, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    assert choice["text"] == PROMPT + expected.text
    logprobs = choice["logprobs"]
    prompt_ids = target.tokenizer.encode(PROMPT)
    assert logprobs["tokens"] == [target.tokenizer.token_bytes(i).decode(errors="replace")
                                  for i in prompt_ids + expected.token_ids]
    values = expected.prompt_logprobs[1:] + expected.logprobs
    assert logprobs["token_logprobs"] == [None] + [lp.logprob for lp in values]
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) in (2, 3)
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][len(prompt_ids)] == len(PROMPT)
    streamed = sse_payloads(client.post("/v1/completions", json={**request, "stream": True}))[:-1]
    assert streamed[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"]
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"] is not None]
    assert {key: [v for part in parts for v in part[key]] for key in logprobs} == logprobs


def test_echo_with_no_tokens_scores_the_prompt_alone(client, spec_client, target):
    ids = target.tokenizer.encode(PROMPT)
    request = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    body = client.post("/v1/completions", json=request).json()
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert all(value < 0 for value in choice["logprobs"]["token_logprobs"][1:])
    [speculative] = spec_client.post("/v1/completions", json=request).json()["choices"]
    assert speculative["logprobs"] == choice["logprobs"]


def test_echo_without_logprobs_sends_the_prompt_first(client):
    request = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=request).json()["choices"][0]
    [echoed] = client.post("/v1/completions", json={**request, "echo": True}).json()["choices"]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["logprobs"] is None
    streamed = sse_payloads(client.post("/v1/completions", json={**request, "echo": True, "stream": True}))[:-1]
    assert streamed[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in streamed) == echoed["text"]


def test_penalties_answer_as_generate_does(client, spec_client, target):
    options = {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    request = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **options}
    expected = generate(target, PROMPT, max_tokens=20, ignore_eos=True, **options)
    assert expected.token_ids != generate(target, PROMPT, max_tokens=20, ignore_eos=True).token_ids
    for server in (client, spec_client):
        assert server.post("/v1/completions", json=request).json()["choices"][0]["text"] == expected.text


def test_a_stop_token_id_ends_the_text_before_it(spec_client, target):
    full = generate(target, PROMPT, max_tokens=16, ignore_eos=True)
    stop = full.token_ids[6]
    expected = generate(target, PROMPT, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    assert expected.token_ids == full.token_ids[:full.token_ids.index(stop)]
    body = spec_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                                     "ignore_eos": True, "stop_token_ids": [stop]}).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)


def test_min_tokens_holds_off_a_stop_token(spec_client, target):
    full = generate(target, PROMPT, max_tokens=16, ignore_eos=True)
    stop = full.token_ids[2]
    request = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}
    early = spec_client.post("/v1/completions", json=request).json()
    held = spec_client.post("/v1/completions", json={**request, "min_tokens": 8}).json()
    assert early["usage"]["completion_tokens"] == full.token_ids.index(stop)
    assert held["usage"]["completion_tokens"] >= 8
    assert held["choices"][0]["text"] == generate(target, PROMPT, max_tokens=16, ignore_eos=True,
                                                  stop_token_ids=[stop], min_tokens=8).text


def test_logit_bias_answers_as_generate_does(client, spec_client, target):
    plain = generate(target, PROMPT, max_tokens=12, ignore_eos=True)
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[5]: 3.0}
    expected = generate(target, PROMPT, max_tokens=12, ignore_eos=True, logit_bias=bias)
    assert plain.token_ids[0] not in expected.token_ids
    request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
               "logit_bias": {str(token): amount for token, amount in bias.items()}}
    for server in (client, spec_client):
        assert server.post("/v1/completions", json=request).json()["choices"][0]["text"] == expected.text


def test_a_suffix_fills_in_the_middle(client):
    """A completion with a suffix answers as generate() does; "" asks for nothing; a suffix
    after token ids, with echo, on chat or for a model with no marks is a clear 400."""
    coder = tiny_model(byte_tokenizer(specials=[*SPECIALS, "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]))
    server = TestClient(create_app(coder, draft=coder, gamma=3))
    suffix = "\n\nprint(add(1, 2))\n"
    expected = generate(coder, PROMPT, suffix=suffix, max_tokens=10, ignore_eos=True)
    request = {"prompt": PROMPT, "suffix": suffix, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    body = server.post("/v1/completions", json=request).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(coder.tokenizer.encode_infill(PROMPT, suffix))
    chunks = sse_payloads(server.post("/v1/completions", json={**request, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]) == expected.text
    end_of_text = coder.tokenizer.vocab["<|endoftext|>"]  # ends a middle, not other text
    forced = {**request, "ignore_eos": False, "min_tokens": 3, "logit_bias": {str(end_of_text): 100}}
    body = server.post("/v1/completions", json=forced).json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "stop"
    unframed = generate(coder, PROMPT, max_tokens=10, ignore_eos=True).text
    assert unframed != expected.text
    assert server.post("/v1/completions", json={**request, "suffix": ""}).json()["choices"][0]["text"] == unframed
    assert_error(server.post("/v1/completions", json={**request, "prompt": [5, 6]}), 400, "text prompt")
    assert_error(server.post("/v1/completions", json={**request, "echo": True}), 400, "echo and suffix")
    chat = {"messages": MESSAGES, "suffix": suffix, "max_tokens": 4}
    assert_error(server.post("/v1/chat/completions", json=chat), 400, "suffix")
    assert_error(client.post("/v1/completions", json=request), 400, "no fill-in-the-middle tokens")


GRAMMAR = 'start: "x" ("a" | "b")+ "y"'


def test_response_format_and_guided_regex_hold_the_output(client, spec_client, target):
    """json_object / json_schema and vLLM's guided_regex and guided_grammar answer as generate()
    does, plainly and speculatively; a bad schema, regex or grammar, or one with ignore_eos, is a
    400 before queueing."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
              {"json_schema": schema}),
             ({"response_format": {"type": "json_object"}}, {"json_schema": True}),
             ({"guided_regex": "[ab]{3}c"}, {"regex": "[ab]{3}c"}),
             ({"guided_grammar": GRAMMAR}, {"grammar": GRAMMAR}),
             ({"response_format": {"type": "text"}}, {})]
    for fields, options in cases:
        expected = generate(target, MESSAGES, max_tokens=24, **options).text
        for server in (client, spec_client):
            body = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24,
                                                             "temperature": 0, **fields}).json()
            assert body["choices"][0]["message"]["content"] == expected
    assert expected != generate(target, MESSAGES, max_tokens=24, regex="[ab]{3}c").text
    request = {"prompt": PROMPT, "max_tokens": 8}
    assert_error(client.post("/v1/completions", json={**request, "guided_regex": "[ab"}), 400, "could not be compiled")
    assert_error(client.post("/v1/completions", json={**request, "guided_grammar": "start: ("}), 400,
                 "the grammar could not be compiled")
    assert_error(client.post("/v1/completions", json={**request, "guided_grammar": GRAMMAR, "guided_regex": "a"}),
                 400, "not a regular expression and a grammar")
    bad_schema = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    assert_error(client.post("/v1/completions", json={**request, "response_format": bad_schema}), 400, "nonsense")
    assert_error(client.post("/v1/completions", json={**request, "response_format": {"type": "xml"}}), 400,
                 "response_format")
    assert_error(client.post("/v1/completions", json={**request, "guided_regex": "a+", "ignore_eos": True}), 400,
                 "leave out ignore_eos")


def test_n_choices_are_the_seeds_one_after_another(client, spec_client, target):
    request = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True, "n": 3,
               "best_of": 3, "logprobs": 1}
    for server in (client, spec_client):
        # compared with the server's own single choices: speculative sampling draws other random numbers
        single = {**request, "n": 1, "best_of": 1}
        expected = [server.post("/v1/completions", json={**single, "seed": 5 + i}).json()["choices"][0]["text"]
                    for i in range(3)]
        assert len(set(expected)) > 1
        body = server.post("/v1/completions", json=request).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["text"] for c in body["choices"]] == expected
        assert all(c["logprobs"]["text_offset"][0] == 0 for c in body["choices"])  # each choice's own offsets
        assert body["usage"]["completion_tokens"] == 30
        assert body["usage"]["prompt_tokens"] == len(target.tokenizer.encode(PROMPT))
    assert body["verispec"]["drafted"] > 0 and body["verispec"]["acceptance_rate"] == 1.0  # its own draft


def test_n_choices_stream_by_index(spec_client):
    request = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 2}
    for url, body, key in (("/v1/completions", {"prompt": PROMPT, "echo": True}, "text"),
                           ("/v1/chat/completions", {"messages": MESSAGES}, "content")):
        whole = spec_client.post(url, json={**request, **body}).json()
        chunks = sse_payloads(spec_client.post(url, json={**request, **body, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
        assert chunks[-1] == "[DONE]" and chunks[-2]["usage"] == whole["usage"]
        indices = [c["choices"][0]["index"] for c in chunks[:-2]]
        assert indices == sorted(indices) and set(indices) == {0, 1}  # one choice after the other
        for index, choice in enumerate(whole["choices"]):
            parts = [c["choices"][0] for c in chunks[:-2] if c["choices"][0]["index"] == index]
            texts = [p[key] if key == "text" else p["delta"].get("content") or "" for p in parts]
            expected = choice["text"] if key == "text" else choice["message"]["content"]
            assert "".join(texts) == expected
            assert [p["finish_reason"] for p in parts][-1] == choice["finish_reason"]
            if key == "content":
                assert parts[0]["delta"]["role"] == "assistant"
        # the whole response's counts are the choices' added up
        finals = [c["verispec"] for c in chunks[:-2] if c["choices"][0]["finish_reason"]]
        assert len(finals) == 2
        for count in ("drafted", "accepted", "target_passes"):
            assert whole["verispec"][count] == sum(f[count] for f in finals) > 0


def test_a_batch_of_prompts_answers_each_in_turn(client, spec_client, target):
    """OpenAI's batch: prompt k's n choices are choices k·n to k·n + n - 1, each the answer of
    that prompt alone; each prompt counts once in the usage, and echoes its own text."""
    other = "a dog ran after the cat"
    request = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 0}
    for server in (client, spec_client):
        alone = [server.post("/v1/completions", json={**request, "prompt": p}).json()["choices"][0]
                 for p in (PROMPT, other)]
        body = server.post("/v1/completions", json={**request, "prompt": [PROMPT, other], "n": 2}).json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2
        assert body["choices"][2]["text"].startswith(other)
        assert body["choices"][3]["logprobs"] == alone[1]["logprobs"]
        prompt_tokens = [len(target.tokenizer.encode(p)) for p in (PROMPT, other)]
        assert body["usage"] == {"prompt_tokens": sum(prompt_tokens), "completion_tokens": 24,
                                 "total_tokens": sum(prompt_tokens) + 24}
    ids = [target.tokenizer.encode(p) for p in (PROMPT, other)]
    def texts(prompt) -> list[str]:
        body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
        return [c["text"] for c in body["choices"]]

    assert texts(ids) == texts(ids[0]) + texts(ids[1])  # a batch of token-id prompts


def test_a_batch_of_prompts_streams_choice_after_choice(spec_client):
    request = {"prompt": [PROMPT, "a dog ran"], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
               "echo": True}
    whole = spec_client.post("/v1/completions", json=request).json()
    chunks = sse_payloads(spec_client.post("/v1/completions", json={**request, "stream": True,
                                                                    "stream_options": {"include_usage": True}}))
    assert chunks[-2]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        parts = [c["choices"][0]["text"] for c in chunks[:-2] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(parts) == choice["text"]
    assert whole["choices"][1]["text"].startswith("a dog ran")


def test_seeds_of_later_choices_wrap_within_64_bits():
    from verispec.sampling import SEED_MAX
    from verispec.server.app import Job

    job = Job([1], {"seed": SEED_MAX - 1}, choices=3)
    assert [job.choice_options(i)["seed"] for i in range(3)] == [SEED_MAX - 1, SEED_MAX, 0]
    assert Job([1], {"seed": None}, choices=2).choice_options(1)["seed"] is None


def test_text_offsets_count_characters_not_bytes(target):
    from verispec.events import Logprob
    from verispec.server.responses import LogprobsShape

    ids = target.tokenizer.encode("a\u00e9\u20acb")  # 1, 2, 3 and 1 bytes: one token per byte here
    assert len(ids) == 7
    whole = LogprobsShape(target.tokenizer, chat=False).body(ids, [Logprob(-1.0)] * 7)
    assert whole["text_offset"] == [0, 1, 1, 2, 2, 2, 3]  # a character's bytes all start where it does
    assert whole["tokens"][0] == "a" and whole["tokens"][1] == "\ufffd"
    streamed = LogprobsShape(target.tokenizer, chat=False)
    parts = [streamed.body(ids[:2], [Logprob(-1.0)] * 2), streamed.body(ids[2:], [Logprob(-1.0)] * 5)]
    assert parts[0]["text_offset"] + parts[1]["text_offset"] == whole["text_offset"]


def test_seeded_sampling_repeats(client):
    request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    first = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    second = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    assert first == second


def test_seed_range_is_what_torch_accepts():
    from verispec.sampling import SEED_MAX, SEED_MIN, SamplingParams

    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        SamplingParams(temperature=1.0, seed=seed).generator()
    for seed in (SEED_MIN - 1, SEED_MAX + 1, 99999999999999999999999):
        with pytest.raises(VerispecError, match=f"seed must be an integer from {SEED_MIN} to {SEED_MAX}"):
            SamplingParams(temperature=1.0, seed=seed)


# ---------------------------------------------------------------- speculative


def test_speculative_equals_baseline(client, spec_client):
    for stream in (False, True):
        request = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": stream}
        baseline, speculative = client.post("/v1/completions", json=request), spec_client.post(
            "/v1/completions", json=request)
        if stream:
            texts = ["".join(c["choices"][0]["text"] for c in sse_payloads(r)[:-1]) for r in (baseline, speculative)]
            assert texts[0] == texts[1]
        else:
            assert speculative.json()["choices"] == baseline.json()["choices"]
            stats = speculative.json()["verispec"]
            assert stats["draft"] == "tiny"
            assert stats["acceptance_rate"] == 1.0  # the target drafting for itself
            assert stats["tokens_per_pass"] > 1.0
            assert stats["accepted"] == stats["drafted"] > 0
            assert stats["target_passes"] < 20


def test_ngram_draft_equals_baseline(client, target):
    ngram_client = TestClient(create_app(target, draft="ngram", gamma=4))
    request = {"prompt": "abcabcabcabc", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    speculative = ngram_client.post("/v1/completions", json=request).json()
    assert speculative["choices"] == client.post("/v1/completions", json=request).json()["choices"]
    assert speculative["verispec"]["draft"] == "ngram"


def test_a_limited_draft_vocabulary_serves_the_same_answer(client, target):
    limited = TestClient(create_app(target, draft=target, gamma=3, draft_vocab=100))
    request = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answer = limited.post("/v1/completions", json=request).json()
    assert answer["choices"] == client.post("/v1/completions", json=request).json()["choices"]
    with pytest.raises(VerispecError, match="applies to a draft model only"):
        create_app(target, draft="ngram", draft_vocab=100)


def test_metrics_counters_move(target):
    app_client = TestClient(create_app(target, draft=target, gamma=3, served_model_name="served"))
    assert metric(app_client, "verispec:spec_decode_num_draft_tokens_total") == 0
    assert metric(app_client, "verispec:request_success_total", finished_reason="length") == 0
    body = app_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                    "ignore_eos": True}).json()
    stats, usage = body["verispec"], body["usage"]
    assert body["model"] == "served"
    assert 'model_name="served"' in app_client.get("/metrics").text
    assert metric(app_client, "verispec:spec_decode_num_draft_tokens_total") == stats["drafted"] > 0
    assert metric(app_client, "verispec:spec_decode_num_accepted_tokens_total") == stats["accepted"]
    assert metric(app_client, "verispec:spec_decode_num_target_passes_total") == stats["target_passes"]
    drafts = metric(app_client, "verispec:spec_decode_num_drafts_total")
    assert 0 < drafts <= stats["target_passes"] - 1
    for position in range(3):  # every draft is kept when the target drafts for itself
        assert metric(app_client, "verispec:spec_decode_num_accepted_tokens_per_pos_total",
                      position=str(position)) == drafts
        assert metric(app_client, "verispec:spec_decode_num_draft_tokens_per_pos_total",
                      position=str(position)) == drafts
    assert metric(app_client, "verispec:generation_tokens_total") == usage["completion_tokens"] == 10
    assert stats["accepted"] + stats["recovered"] + stats["bonus"] + stats["plain"] == 10
    assert stats["plain"] == stats["target_passes"] - drafts  # each pass that checked no drafts gave one
    assert metric(app_client, "verispec:prompt_tokens_total") == usage["prompt_tokens"]
    assert metric(app_client, "verispec:request_success_total", finished_reason="length") == 1
    # a streamed request counts too
    app_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                             "ignore_eos": True, "stream": True})
    assert metric(app_client, "verispec:request_success_total", finished_reason="length") == 2
    assert metric(app_client, "verispec:generation_tokens_total") == 20
    assert metric(app_client, "verispec:num_requests_running") == 0
    # each choice reads its prompt, where the usage counts the prompt once
    read = metric(app_client, "verispec:prompt_tokens_total")
    body = app_client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2}).json()
    assert metric(app_client, "verispec:prompt_tokens_total") - read == 2 * body["usage"]["prompt_tokens"]


def test_baseline_serving_leaves_the_speculative_counters_alone(client):
    before = metric(client, "verispec:generation_tokens_total")
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True})
    assert metric(client, "verispec:generation_tokens_total") == before + 4
    assert metric(client, "verispec:spec_decode_num_draft_tokens_total") == 0


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == CONTEXT
    assert client.get("/health").json()["status"] == "ok"


# ---------------------------------------------------------------- mistakes


def assert_error(response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


@pytest.mark.parametrize("body,fragments,param", [
    ({"max_tokens": 4}, ["missing", "prompt"], "prompt"),
    ({"prompt": PROMPT, "max_tokens": -1}, ["max_tokens", "greater than or equal to 0"], "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0}, ["max_tokens=0 decodes nothing", "echo: true"], None),
    ({"prompt": PROMPT, "temperature": 2.5}, ["temperature", "less than or equal to 2"], "temperature"),
    ({"prompt": PROMPT, "temperature": -0.1}, ["temperature"], "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, ["top_p", "greater than 0"], "top_p"),
    ({"prompt": PROMPT, "n": 0}, ["n", "greater than or equal to 1"], "n"),
    ({"prompt": PROMPT, "n": 129}, ["n", "less than or equal to 128"], "n"),
    ({"prompt": PROMPT, "n": 2, "best_of": 3}, ["best_of=3 is not supported"], None),
    ({"prompt": PROMPT, "seed": 99999999999999999999999}, ["seed", "less than or equal to 18446744073709551615"],
     "seed"),
    ({"prompt": PROMPT, "seed": -(2**63) - 1}, ["seed", "greater than or equal to -9223372036854775808"], "seed"),
    ({"prompt": PROMPT, "echo": "maybe"}, ["echo", "boolean"], "echo"),
    ({"prompt": PROMPT, "logprobs": 21}, ["logprobs", "less than or equal to 20"], "logprobs"),
    ({"prompt": PROMPT, "logprobs": -1}, ["logprobs", "greater than or equal to 0"], "logprobs"),
    ({"prompt": PROMPT, "logprobs": True}, ["logprobs takes the number of likeliest ids", "not true"], "logprobs"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, ["presence_penalty", "less than or equal to 2"],
     "presence_penalty"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, ["repetition_penalty", "greater than 0"], "repetition_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"a": 3}}, ["logit_bias", "valid integer"], "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, ["logit_bias", "less than or equal to 100"], "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {"99999": 1}}, ["99999", "outside the model's vocabulary"], None),
    ({"prompt": PROMPT, "stop_token_ids": [99999]}, ["99999", "outside the model's vocabulary"], None),
    ({"prompt": PROMPT, "stop_token_ids": ["a"]}, ["stop_token_ids", "valid integer"], "stop_token_ids"),
    ({"prompt": PROMPT, "min_tokens": -1}, ["min_tokens", "greater than or equal to 0"], "min_tokens"),
    ({"prompt": PROMPT, "min_tokens": 20}, ["min_tokens (20) is more than max_tokens (16)"], None),
    ({"prompt": [PROMPT] * 65, "n": 2}, ["at most 128 completions", "got 130"], None),
    ({"prompt": [PROMPT, ""]}, ["prompt 1 of the batch", "prompt is empty"], None),
    ({"prompt": [[1, 2], [3, 99999]]}, ["prompt 1 of the batch", "99999", "outside the model's vocabulary"], None),
    ({"prompt": [PROMPT, [1, 2]]}, ["prompt must be"], "prompt"),
    ({"prompt": [PROMPT, [1]], "suffix": "x"}, ["prompt must be"], "prompt"),
    ({"prompt": PROMPT, "stop": 5}, ["stop must be a string or a list of strings"], "stop"),
    ({"prompt": 5}, ["prompt must be a string, a list of token ids"], "prompt"),
    ({"prompt": ""}, ["prompt is empty"], None),
    ({"prompt": [1, 99999]}, ["99999", "outside the model's vocabulary"], None),
])
def test_bad_completion_requests(client, body, fragments, param):
    error = assert_error(client.post("/v1/completions", json=body), 400, *fragments)
    assert error["param"] == param


def test_huge_seed_is_a_400_before_a_stream_starts(client):
    for url, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        for stream in (False, True):
            request = {**body, "max_tokens": 2, "temperature": 1, "seed": 99999999999999999999999, "stream": stream}
            error = assert_error(client.post(url, json=request), 400, "seed", "18446744073709551615")
            assert error["param"] == "seed"


def test_neutral_values_of_unsupported_options_are_accepted(client):
    body = {"prompt": PROMPT, "max_tokens": 2, "n": 1, "logprobs": None, "presence_penalty": 0,
            "frequency_penalty": 0.0, "best_of": 1, "echo": False, "user": "someone", "stop": None}
    assert client.post("/v1/completions", json=body).status_code == 200
    answer = client.post("/v1/completions", json={**body, "logprobs": False})
    assert answer.status_code == 200 and answer.json()["choices"][0]["logprobs"] is None
    chat = {"messages": MESSAGES, "max_tokens": 2, "logprobs": False, "top_logprobs": 0}
    answer = client.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200 and answer.json()["choices"][0]["logprobs"] is None


def test_bodies_that_are_not_a_json_object(client):
    json_type = {"content-type": "application/json"}
    assert_error(client.post("/v1/completions", content=b'{"prompt": "x", ', headers=json_type), 400, "not valid JSON")
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=json_type), 400, "must be a JSON object")
    assert_error(client.post("/v1/completions"), 400, "needs a JSON object body")
    form = {"content-type": "application/x-www-form-urlencoded"}
    assert_error(client.post("/v1/completions", content=b"prompt=x", headers=form), 400,
                 "Content-Type: application/json")


def test_json_without_a_content_type_is_read(client, target):
    body = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    response = client.post("/v1/completions", content=json.dumps(body).encode())
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(target.tokenizer.encode(PROMPT))
    assert response.json()["usage"]["completion_tokens"] == 2


def test_prompt_longer_than_the_context(client):
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": "x" * (CONTEXT + 10), "stream": stream})
        error = assert_error(response, 400, f"maximum context length is {CONTEXT} tokens",
                             f"the prompt has {CONTEXT + 10} tokens")
        assert error["code"] == "context_length_exceeded"
    messages = [{"role": "user", "content": "x" * CONTEXT}]
    assert_error(client.post("/v1/chat/completions", json={"messages": messages}), 400, "maximum context length")


@pytest.mark.parametrize("body,fragments", [
    ({}, ["missing", "messages"]),
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, ["messages.0.role"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     ["only text content"]),
    ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, ["does not offer tools"]),
    ({"messages": MESSAGES, "max_completion_tokens": -3}, ["max_completion_tokens"]),
    ({"messages": MESSAGES, "top_logprobs": 3}, ["top_logprobs needs logprobs: true"]),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, ["top_logprobs", "less than or equal to 20"]),
    ({"messages": MESSAGES, "logprobs": "sure"}, ["logprobs", "boolean"]),
    ({"messages": MESSAGES, "echo": True}, ["echo", "not supported"]),
])
def test_bad_chat_requests(client, body, fragments):
    assert_error(client.post("/v1/chat/completions", json=body), 400, *fragments)


def test_chat_without_a_template_is_a_clear_400():
    plain = tiny_model(byte_tokenizer(chat_template=None))
    response = TestClient(create_app(plain)).post("/v1/chat/completions", json={"messages": MESSAGES})
    assert_error(response, 400, "no chat template", "/v1/completions")


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content ",  # does not parse
    "{{ raise_exception('system messages are not supported') }}",  # refuses the messages
])
def test_a_failing_chat_template_is_a_clear_400(template):
    model = tiny_model(byte_tokenizer(chat_template=template))
    response = TestClient(create_app(model)).post("/v1/chat/completions", json={"messages": MESSAGES})
    assert_error(response, 400, "chat template failed on these messages")


def test_unknown_endpoint_and_method(client):
    assert_error(client.get("/v1/engines"), 404, "no such endpoint", "/v1/chat/completions")
    assert_error(client.get("/v1/completions"), 405, "GET is not allowed")


def test_server_still_answers_after_errors(client):
    assert_error(client.post("/v1/completions", json={"prompt": PROMPT, "best_of": 3}), 400, "not supported")
    error = assert_error(client.post("/v1/completions", json={"prompt": "x" * 500, "stream": True}), 400,
                         "maximum context length")
    assert error["code"] == "context_length_exceeded"
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- one request at a time


def test_requests_queue_for_the_model_while_health_and_metrics_answer(target):
    import httpx

    app = create_app(target)
    engine = app.state.engine
    request = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    waiting = 'verispec:num_requests_waiting{model_name="tiny"} 1.0'

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            async with engine.turn():  # the model is busy
                queued = asyncio.create_task(http.post("/v1/completions", json=request))
                metrics_text = ""
                while waiting not in metrics_text:  # until the request has queued
                    await asyncio.sleep(0.01)
                    metrics_text = (await http.get("/metrics")).text
                health = (await http.get("/health")).json()
                assert not queued.done()
            answer = await queued
        return health, metrics_text, answer

    health, metrics_text, answer = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert health["busy"] is True
    assert 'verispec:num_requests_running{model_name="tiny"} 1.0' in metrics_text
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"] == generate(target, PROMPT, max_tokens=6, temperature=0,
                                                           ignore_eos=True).text
    assert not engine.lock.locked()


def test_serving_with_no_lookup_keeps_adaptive_rounds_to_the_draft_model(target, clock):
    """`verispec serve --no-lookup` (create_app(lookup=False)): every request decodes without
    prompt lookup's drafts in the draft model's place; by default they may be sent (the
    policy's costs from the modelled clock, whatever the machine's load)."""
    from verispec.generate import generate as run
    from verispec.server.schemas import CompletionRequest

    request = CompletionRequest(prompt=PROMPT * 3, max_tokens=30, ignore_eos=True, temperature=0)
    for lookup in (True, False):
        engine = create_app(target, draft=target, gamma=4, adaptive="cost", lookup=lookup).state.engine
        options = engine.completion_jobs(request)[0].options
        assert options["lookup"] is lookup
        result = run(target, PROMPT * 3, **options)
        assert (result.spec.lookup_drafted > 0) is lookup


def test_a_client_leaving_mid_stream_frees_the_model(target):
    from verispec.events import Token
    from verispec.server.schemas import CompletionRequest

    app = create_app(target)
    engine = app.state.engine
    job, = engine.completion_jobs(CompletionRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True))

    async def leave_after_one_token():
        events = engine.events([job])
        index, first = await events.__anext__()
        assert engine.lock.locked() and index == 0
        await events.aclose()
        return first

    assert isinstance(asyncio.run(leave_after_one_token()), Token)
    assert not engine.lock.locked()
    client = TestClient(app)
    assert metric(client, "verispec:request_success_total", finished_reason="abort") == 1
    assert metric(client, "verispec:generation_tokens_total") == 1
    assert metric(client, "verispec:prompt_tokens_total") == len(job.prompt_ids)
    assert metric(client, "verispec:num_requests_running") == 0
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


# ---------------------------------------------------------------- start-up


def test_draft_with_another_tokenizer_is_refused_at_start_up(target):
    other = tiny_model(byte_tokenizer(extra_merge=("a", "b")), seed=1, name="other")
    with pytest.raises(TokenizerMismatchError, match="does not match"):
        create_app(target, draft=other)


def test_serve_command_reports_a_tokenizer_mismatch(monkeypatch, capsys, target):
    from verispec import cli
    from verispec.commands import serve

    other = tiny_model(byte_tokenizer(extra_merge=("a", "b")), seed=1, name="other")
    monkeypatch.setattr(serve, "load_target_and_draft", lambda args: (target, other))
    monkeypatch.setattr(serve, "check_port_free", lambda host, port: None)
    assert cli.main(["serve", "--model", "tiny", "--draft", "other", "--port", "8123"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: the draft's tokenizer does not match")
    assert "Traceback" not in err


def test_serve_command_starts_uvicorn(monkeypatch, target):
    from verispec import cli
    from verispec.commands import serve

    started = {}
    monkeypatch.setattr(serve, "load_target_and_draft", lambda args: (target, args.draft))
    monkeypatch.setattr(serve, "check_port_free", lambda host, port: None)
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: started.update(app=app, **kw))
    assert cli.main(["serve", "--model", "tiny", "--draft", "ngram", "--gamma", "6", "--port", "8124"]) == 0
    assert started["host"] == "127.0.0.1" and started["port"] == 8124
    engine = started["app"].state.engine
    assert (engine.draft_name, engine.gamma) == ("ngram", 6)
