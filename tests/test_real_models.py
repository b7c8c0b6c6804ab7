"""What only real checkpoints show: the demo GGUFs against transformers, and the real pair speculating."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from verispec.generate import generate
from verispec.lab.audit import check_output, logit_margin
from verispec.lab.prompts import spec_bench_path

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash table is in two sentences.",
    "def quicksort(items):",
]


def spec_bench_sample(per_category: int = 2, categories: int = 5) -> list[str]:
    by_category: dict[str, list[str]] = defaultdict(list)
    for line in spec_bench_path().read_text().splitlines():
        row = json.loads(line)
        by_category[row["category"]].append(row["turns"][0])
    chosen = sorted(by_category)[:categories]
    return [prompt for name in chosen for prompt in by_category[name][:per_category]]


def test_greedy_output_matches_transformers_on_the_1_5b(real_pair):
    from transformers import AutoModelForCausalLM

    target, _ = real_pair
    reference = AutoModelForCausalLM.from_pretrained(
        str(target.path.parent), gguf_file=target.path.name, dtype=torch.float32)
    reference.eval()
    for prompt in PROMPTS:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        ours = generate(target, ids, max_tokens=48, ignore_eos=True).token_ids
        assert ours == expected, prompt
    del reference


def test_real_pair_speculation_reproduces_the_target(real_pair):
    """10 Spec-Bench prompts from 5 categories; a divergence passes only as a logit tie, with its margin shown."""
    target, draft = real_pair
    prompts = spec_bench_sample()
    assert len(prompts) == 10
    report = []
    for prompt in prompts:
        ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        baseline = generate(target, ids, max_tokens=24).token_ids
        for name, options in {"draft γ=4": dict(draft=draft, gamma=4),
                              "draft γ=12": dict(draft=draft, gamma=12),
                              "ngram γ=4": dict(draft="ngram", gamma=4),
                              "adaptive": dict(draft=draft, gamma=4, adaptive=True)}.items():
            result = generate(target, ids, max_tokens=24, **options)
            spec = result.spec
            assert len(result.token_ids) == spec.accepted + spec.recovered + spec.bonus + spec.plain
            verdict = check_output(baseline, result.token_ids,
                                   lambda at: logit_margin(target, ids, baseline[:at]))
            report.append(f"{name}: {verdict.status} {verdict.reason}")
            assert verdict.valid, verdict.reason
    print("\n".join(report))  # shown with -s: the margin of any tie


def test_real_pair_logprobs_of_kept_drafts_are_plain_decodings(real_pair):
    """A verification pass gives each position the same logits a plain step does, so the
    log-probabilities reported for kept drafts are bit for bit what plain decoding reports."""
    target, draft = real_pair
    ids = target.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    plain = generate(target, ids, max_tokens=24, logprobs=3)
    speculative = generate(target, ids, max_tokens=24, logprobs=3, draft=draft, gamma=5)
    assert speculative.token_ids == plain.token_ids and speculative.spec.accepted > 0
    assert speculative.logprobs == plain.logprobs


def test_real_target_scores_its_answer_as_it_reported_it(real_pair, monkeypatch):
    """Scoring prompt + answer (an evaluation harness's log-likelihood) gives, read in chunks of
    16 positions, the log-probabilities that generating the answer reported, bit for bit."""
    from verispec import generate as generate_module

    monkeypatch.setattr(generate_module, "PROMPT_CHUNK", 16)
    target, _ = real_pair
    ids = target.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    answer = generate(target, ids, max_tokens=24, ignore_eos=True, logprobs=2)
    scored = generate(target, ids + answer.token_ids, max_tokens=0, prompt_logprobs=2)
    assert len(ids) > 16 and scored.token_ids == []
    assert scored.prompt_logprobs[len(ids):] == answer.logprobs


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_streamed_text_is_the_whole_outputs_text_with_real_tokenizers(name):
    """Token by token, TextAssembler hands out exactly what decoding the whole output gives,
    and the tokens' bytes join into the text's."""
    import random

    from verispec.generate import TextAssembler
    from verispec.loading import load_model

    tokenizer = load_model(name).tokenizer
    samples = ["def f(x):\n    return x  # naïve, 😀 über 数据", "  leading spaces\n\n\ttabs and émojis 🚀🚀"]
    rng = random.Random(0)
    ids_list = [tokenizer.encode(s, add_special_tokens=False) for s in samples]
    ids_list += [[rng.randrange(tokenizer.vocab_size) for _ in range(64)] for _ in range(5)]
    for ids in ids_list:
        text = TextAssembler(tokenizer, ())
        joined = "".join(text.add(i)[0] for i in ids) + text.flush()
        assert joined == text.text == tokenizer.decode(ids), ids
    for sample, ids in zip(samples, ids_list):  # what log-probabilities report as each token's bytes
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == sample.encode()


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_embedding_rows_from_the_files_blocks_are_the_decoded_tables(name):
    """The demo files' token embeddings (Q5_0 and Q4_K) looked up block by block give exactly
    the rows of the whole table decoded at once."""
    from verispec.loading import resolve
    from verispec.loading.gguf_file import dequantize, open_reader
    from verispec.quant import embedding_from_gguf

    raw = next(t for t in open_reader(resolve(name)).tensors if t.name == "token_embd.weight")
    table = dequantize(raw)
    embedding = embedding_from_gguf(raw, torch.float32)
    ids = torch.randint(0, table.shape[0], (3, 100), generator=torch.Generator().manual_seed(0))
    assert torch.equal(embedding(ids), table[ids])
    assert embedding.blocks.numel() * 5 < table.numel() * 4  # a fifth of the float32 table, or less


def test_a_draft_limited_to_the_first_ids_proposes_the_prompts_own_words(real_pair):
    """The 0.5B limited to the first 32,768 ids: the code fence's language and a word of the
    function's name lie above the limit. With the context's ids the draft proposes them and
    keeps more of its drafts; either way the output is the target's."""
    from verispec.spec.draft_model import DraftModelProposer

    target, draft = real_pair
    prompt = ("Complete this function:\n```python\ndef fibonacci_memoized(n, memo):\n"
              "    \"\"\"The n-th Fibonacci number, with memo as cache.\"\"\"\n```")
    ids = target.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    plain = generate(target, ids, max_tokens=32)
    runs = {context: generate(target, ids, max_tokens=32, gamma=4,
                              draft=DraftModelProposer(draft, vocab_limit=32768, context_ids=context))
            for context in (False, True)}
    above = {context: [t for t, kind in zip(r.token_ids, r.origins) if kind == "draft" and t >= 32768]
             for context, r in runs.items()}
    assert runs[False].token_ids == runs[True].token_ids == plain.token_ids
    assert above[False] == [] and above[True] and set(above[True]) <= set(ids)
    assert runs[True].spec.acceptance_rate > runs[False].spec.acceptance_rate


def test_a_limited_draft_proposes_latex_before_the_answer_has_it(real_pair):
    """\\frac lies above the 0.5B's first 32,768 ids and not in this prompt: with Markdown's
    marks, its math's included, the limited draft proposes the answer's first \\frac, which
    without them only the target can choose; either way the output is the target's."""
    from verispec.spec.draft_model import DraftModelProposer

    target, draft = real_pair
    question = "What is 3/4 + 1/6? Answer with a LaTeX fraction."
    ids = target.tokenizer.encode_chat([{"role": "user", "content": question}])
    frac = target.tokenizer.encode("\\frac", add_special_tokens=False)[-1]
    assert frac >= 32768 and frac not in ids
    plain = generate(target, ids, max_tokens=24)
    assert frac in plain.token_ids
    runs = {marks: generate(target, ids, max_tokens=24, gamma=4,
                            draft=DraftModelProposer(draft, vocab_limit=32768, markdown=marks))
            for marks in (False, True)}
    first = {marks: r.origins[r.token_ids.index(frac)] for marks, r in runs.items()}
    assert runs[False].token_ids == runs[True].token_ids == plain.token_ids
    assert first[False] != "draft" and first[True] == "draft"


def test_the_coder_fills_in_a_function_body_and_speculation_keeps_it(real_pair):
    """The 1.5B writes the gap between a signature and a call and ends the middle itself;
    the 0.5B draft's speculation gives the same tokens."""
    target, draft = real_pair
    prefix, suffix = "def add(a, b):\n    return ", "\n\n\nprint(add(2, 3))\n"
    plain = generate(target, prefix, suffix=suffix, max_tokens=32)
    assert plain.finish_reason == "eos" and "a + b" in plain.text
    assert generate(target, prefix, suffix=suffix, max_tokens=32, draft=draft, gamma=4).token_ids == plain.token_ids


def test_the_coder_answers_in_the_schema_and_speculation_keeps_it(real_pair):
    """Held to a JSON schema, the 1.5B's chat answer parses and has the schema's keys; the
    0.5B draft, masked alike, gives the same tokens."""
    target, draft = real_pair
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {
        "type": "array", "items": {"type": "string"}}}, "required": ["name", "arguments"], "additionalProperties": False}
    prompt = "Describe the Python function def add(a, b) as JSON: its name and its arguments."
    plain = generate(target, prompt, chat=True, max_tokens=64, json_schema=schema)
    value = json.loads(plain.text)
    assert plain.finish_reason == "eos" and value["name"] == "add" and value["arguments"] == ["a", "b"]
    spec = generate(target, prompt, chat=True, max_tokens=64, json_schema=schema, draft=draft, gamma=4)
    assert spec.token_ids == plain.token_ids and spec.spec.acceptance_rate > 0.5


def test_the_coder_calls_a_tool_through_the_server_and_speculation_keeps_it(real_pair):
    """Offered a tool, the 1.5B calls it with the city from the question: left to choose, it
    answers with the call alone in a ```json block (not in Qwen2.5's tags); asked to call, it is
    held to the tags. The server reads the call either way, plainly and with the 0.5B draft."""
    from fastapi.testclient import TestClient

    from verispec.server import create_app

    target, draft = real_pair
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    servers = [TestClient(create_app(target, **options)) for options in ({}, {"draft": draft, "gamma": 4})]
    for tool_choice in ("auto", "required"):
        request = {"messages": [{"role": "user", "content": "What is the weather in Paris right now?"}],
                   "tools": [weather], "tool_choice": tool_choice, "max_tokens": 48, "temperature": 0}
        answers = [server.post("/v1/chat/completions", json=request).json() for server in servers]
        for body in answers:
            [choice] = body["choices"]
            [call] = choice["message"]["tool_calls"]
            assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
            assert "paris" in json.loads(call["function"]["arguments"])["city"].lower()
        assert [c["function"] for c in answers[0]["choices"][0]["message"]["tool_calls"]] == [
            c["function"] for c in answers[1]["choices"][0]["message"]["tool_calls"]]
        assert answers[1]["verispec"]["acceptance_rate"] > 0.5
