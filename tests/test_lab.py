"""The lab on tiny random models: prompts, audits, bench, sweep resumption, reports from JSONL, the demo."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.lab import audit, bench, report, sweep
from verispec.lab.prompts import SPEC_BENCH_ENV, Prompt, load_prompts
from verispec.lab.records import RecordWriter, read_records
from verispec.loading import load_model

FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = ["Write a function that adds two numbers.", "abab cdcd abab cdcd abab cdcd", "Tell me about cats."]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders of a tiny target, an identical copy (every draft kept) and an unrelated draft."""
    root = tmp_path_factory.mktemp("lab-models")
    for name, seed in (("target", 0), ("same", 0), ("other", 1)):
        tiny.save_hf_model(root / name, "qwen2", seed=seed, max_position_embeddings=2048)
    return root


@pytest.fixture(scope="module")
def loaded(models):
    return {name: load_model(models / name) for name in ("target", "same", "other")}


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps table headers in a narrow terminal


def run_cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out + err


def small_settings(**overrides) -> bench.BenchSettings:
    return bench.BenchSettings(**{"max_tokens": 10, "repeats": 1, "warmup": False, **overrides})


# ---------------------------------------------------------------- prompts


@pytest.fixture
def fake_spec_bench(tmp_path, monkeypatch):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"{cat} question {i}", "second turn"]}
            for i, cat in enumerate(["coding"] * 3 + ["writing"] * 3 + ["qa"] * 3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(SPEC_BENCH_ENV, str(path))
    return path


def test_spec_bench_categories_and_limits(fake_spec_bench):
    assert [p.text for p in load_prompts("spec-bench:coding", 2)] == ["coding question 0", "coding question 1"]
    assert [p.category for p in load_prompts("spec-bench:coding,qa", 1)] == ["coding", "qa"]
    spread = load_prompts("spec-bench", 4)
    assert [p.category for p in spread] == ["coding", "writing", "qa", "coding"]
    assert len(load_prompts("spec-bench")) == 9
    with pytest.raises(VerispecError, match="unknown Spec-Bench category nope"):
        load_prompts("spec-bench:nope")


def test_spec_bench_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(SPEC_BENCH_ENV, str(tmp_path / "absent.jsonl"))
    with pytest.raises(VerispecError, match="VERISPEC_SPEC_BENCH points to"):
        load_prompts("spec-bench")


def test_spec_bench_ships_with_verispec(monkeypatch):
    """Without the variable the packaged copy serves, whole: 480 questions in 13 categories."""
    monkeypatch.delenv(SPEC_BENCH_ENV, raising=False)
    prompts = load_prompts("spec-bench")
    assert len(prompts) == 480
    counts = Counter(p.category for p in prompts)
    assert len(counts) == 13 and counts["coding"] == 10 and counts["translation"] == 80
    assert all(p.text.strip() for p in prompts)


def test_prompt_files(tmp_path, prompt_file):
    assert [p.text for p in load_prompts(str(prompt_file))] == PROMPTS
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"turns": ["first", "ignored"], "category": "x"}\n{"turns": ["second"]}\n')
    assert [(p.text, p.category) for p in load_prompts(str(jsonl))] == [("first", "x"), ("second", "default")]
    jsonl.write_text('{"prompt": "no turns"}\n')
    with pytest.raises(VerispecError, match="'turns'"):
        load_prompts(str(jsonl))
    with pytest.raises(VerispecError, match="no prompts at"):
        load_prompts(str(tmp_path / "missing.txt"))


# ---------------------------------------------------------------- audit rules


def test_seed_rows_are_impossible(capsys):
    code, out = run_cli(capsys, "audit", FIXTURES / "seed_rows.csv")
    assert code != 0
    assert out.count("IMPOSSIBLE") == 3
    assert "1 + γ·acceptance = 1 + 4 × 0.002 = 1.008x" in out
    assert "3 of 3 row(s) fail" in out


def test_audit_rows(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    plausible = {"baseline_tok_s": 10, "spec_tok_s": 15, "gamma": 4, "acceptance": 0.7}
    rows.write_text(json.dumps(plausible) + "\n")
    code, out = run_cli(capsys, "audit", rows)
    assert code == 0 and "VALID" in out
    # the seed's 9B bf16 at γ = 16: 14.8 ms per token, under the 22 ms that reading 17.9 GB at 800 GB/s takes
    too_fast = {"baseline_tok_s": 40, "spec_tok_s": 1000 / 14.8, "gamma": 16, "acceptance": 0.02,
                "model_bytes": 17.9e9, "bandwidth_gb_s": 800}
    verdict = audit.audit_row(too_fast)
    assert verdict.status == audit.IMPOSSIBLE
    assert "exceeds 1 + γ·acceptance" in verdict.reason and "17.9 GB per pass at 800 GB/s" in verdict.reason
    assert audit.audit_row({**plausible, "acceptance": 1.3}).status == audit.INVALID
    assert audit.audit_row({**plausible, "speedup": 2.0}).status == audit.INVALID
    assert audit.audit_row({**plausible, "acceptance": "70%"}).valid


def test_output_check_and_ties():
    same = audit.check_output([1, 2, 3], [1, 2, 3])
    assert same.status == audit.VALID
    tie = audit.check_output([1, 2, 3], [1, 2, 4], lambda at: (1e-6, 1e-4))
    assert tie.status == audit.TIE and tie.margin == 1e-6
    wrong = audit.check_output([1, 2, 3], [1, 5, 3], lambda at: (0.7, 1e-4))
    assert wrong.status == audit.INVALID and "token 1" in wrong.reason
    assert audit.first_difference([1, 2], [1, 2, 3]) == 2


def test_logit_margin_is_the_target_top_two_gap(loaded):
    target = loaded["target"]
    prompt, prefix = [5, 6, 7], [8, 9]
    margin, tolerance = audit.logit_margin(target, prompt, prefix)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + prefix]), target.model.new_cache(8))[0, -1]
    top = logits.topk(2).values
    assert margin == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert 0 < tolerance < 0.01


def test_accounting_catches_counters_that_do_not_add_up():
    spec = {"rounds": 4, "drafted": 6, "accepted": 4, "recovered": 2, "bonus": 1,
            "accepted_by_position": [2, 2]}
    assert audit.check_accounting(spec, 7, target_passes=4).valid
    assert not audit.check_accounting(spec, 8).valid
    assert "passes" in audit.check_accounting(spec, 7, target_passes=5).reason
    assert not audit.check_accounting({**spec, "accepted_by_position": [3, 2]}, 7).valid


def test_accounting_keeps_plain_steps_apart_from_bonus_tokens():
    """A pass that checked no drafts gives a `plain` token (origin "target"), not a bonus one.
    Records of older versions have no `plain` and counted those tokens as bonus: still valid."""
    origins = ["target", "draft", "draft", "bonus", "target", "draft", "recovered"]
    spec = {"rounds": 4, "drafted": 5, "accepted": 3, "recovered": 1, "bonus": 1, "plain": 2}
    assert audit.check_accounting(spec, 7, origins, target_passes=4).valid
    swapped = {**spec, "bonus": 2, "plain": 1}  # the sum still adds up, the origins do not
    assert "origins" in audit.check_accounting(swapped, 7, origins).reason
    older = {key: value for key, value in swapped.items() if key != "plain"}
    assert not audit.check_accounting(older, 7, origins).valid
    assert audit.check_accounting({**older, "bonus": 3}, 7, origins).valid


# ---------------------------------------------------------------- sampled output against the target's distribution


def test_uniformity_p_value_agrees_with_scipy():
    from scipy import stats

    rng = np.random.default_rng(0)
    for n, skew in [(5, 1.0), (40, 1.0), (40, 2.0), (128, 1.0), (128, 1.5), (1000, 1.15), (1000, 1.0)]:
        values = rng.random(n) ** skew  # skew > 1 piles values up towards 0
        expected = stats.kstest(values, "uniform").pvalue
        assert audit.uniformity_p_value(values.tolist()) == pytest.approx(expected, rel=0.1, abs=3e-3)
    assert audit.uniformity_p_value([]) == 1.0


def test_randomized_pit_passes_draws_from_the_distribution_only():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(2000, 50, generator=gen), -1)
    drawn = torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()
    values, impossible = audit.randomized_pit(probs, drawn, gen)
    assert impossible == 0 and min(values) >= 0 and max(values) <= 1
    assert audit.check_sampled_output(audit.SampledEvidence(values)).valid
    other = torch.softmax(2 * torch.randn(2000, 50, generator=gen), -1)  # another model's distribution
    for tokens in (probs.argmax(-1).tolist(), torch.multinomial(other, 1, generator=gen)[:, 0].tolist()):
        verdict = audit.check_sampled_output(audit.SampledEvidence(audit.randomized_pit(probs, tokens, gen)[0]))
        assert verdict.status == audit.INVALID and "not drawn from the target's distribution" in verdict.reason
    cut = probs.clone()
    cut[0, drawn[0]] = 0.0  # a token the distribution cannot give (outside top-k, say)
    values, impossible = audit.randomized_pit(cut, drawn, gen)
    assert impossible == 1 and "probability 0" in audit.check_sampled_output(audit.SampledEvidence(values, 1)).reason


def test_the_draft_lean_martingale_holds_its_level_and_grows_on_tokens_that_lean_towards_the_draft():
    """Under the target's distribution the p-value from Ville's inequality is at most its level
    as often as the level says; tokens from the draft, or from a mix of 3 parts target and 1
    part draft, drive it to nothing. The draft's vocabulary may be wider or narrower."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(400, 30, 20, generator=gen), -1)  # 400 outputs of 30 tokens
    q = torch.softmax(torch.randn(400, 30, 20, generator=gen), -1)
    null = [audit.draft_lean_p_value([audit.draft_lean_logs(p[i], q[i], torch.multinomial(p[i], 1, generator=gen)[:, 0]
                                                            .tolist())]) for i in range(400)]
    assert sum(v < 0.1 for v in null) <= 0.1 * 400 + 3 * (0.09 * 400) ** 0.5 and max(null) <= 1.0
    rows = p.reshape(-1, 20)[:2000], q.reshape(-1, 20)[:2000]
    for source in (rows[1], 0.75 * rows[0] + 0.25 * rows[1]):
        tokens = torch.multinomial(source, 1, generator=gen)[:, 0].tolist()
        assert audit.draft_lean_p_value([audit.draft_lean_logs(*rows, tokens)]) < 1e-6
    wider = torch.cat([rows[1], torch.full((2000, 5), 0.1)], 1)  # padding rows the target lacks
    tokens = torch.multinomial(rows[1], 1, generator=gen)[:, 0].tolist()
    assert audit.draft_lean_logs(rows[0], wider, tokens) == audit.draft_lean_logs(rows[0], rows[1], tokens)
    assert len(audit.draft_lean_logs(rows[0], rows[1][:, :15], tokens)) == len(audit.DRAFT_WEIGHTS)


def test_the_lookup_lean_grows_on_copied_tokens_the_target_finds_unlikely():
    """Prompt lookup's draft is the token after the last n-gram's earlier occurrence. An output
    that copies the context where the target's draws would not is refused; draws from the
    target are not, and positions with no n-gram found leave the martingale as it is."""
    from verispec.spec.prompt_lookup import PromptLookupProposer

    gen = torch.Generator().manual_seed(2)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 3
    p = torch.softmax(torch.randn(60, 40, generator=gen), -1)  # ids 5..12 get no special mass
    copied = (prompt * 3)[:60]  # the prompt's cycle, continued: lookup's drafts every time
    drawn = torch.multinomial(p, 1, generator=gen)[:, 0].tolist()
    lean = audit.lookup_lean_logs(p, PromptLookupProposer(3, 1), prompt, copied)
    assert audit.draft_lean_p_value([lean]) < 1e-10
    assert audit.draft_lean_p_value([audit.lookup_lean_logs(p, PromptLookupProposer(3, 1), prompt, drawn)]) > 1e-3
    unseen = list(range(30, 40))  # ids the context never held: no n-gram, no lean either way
    lean = audit.lookup_lean_logs(p[:10], PromptLookupProposer(3, 3), [1, 2, 3], unseen)
    assert lean == pytest.approx([0.0] * 3, abs=1e-12)


def test_model_probabilities_follow_the_decoding_steps(loaded):
    """The audit's teacher-forced passes give the distributions the sampler drew from, position by position."""
    from verispec.sampling import SamplingParams, probabilities

    target, params = loaded["target"], SamplingParams(temperature=0.7, top_k=40)
    prompt, output = list(range(5, 25)), list(range(30, 100))
    got = audit.model_probabilities(target, prompt, output, params, chunk=16)
    assert got.shape == (len(output), tiny.VOCAB)
    with torch.inference_mode():
        cache = target.model.new_cache(len(prompt) + len(output))
        steps = [target.model(torch.tensor([prompt]), cache, last_only=True)[0, -1]]
        steps += [target.model(torch.tensor([[token]]), cache)[0, -1] for token in output[:-1]]
    expected = probabilities(torch.stack(steps), params)
    assert torch.allclose(got, expected, atol=1e-5)


def sampled_bench(loaded, proposer: str) -> list[dict]:
    settings = small_settings(max_tokens=48, temperature=0.5, ignore_eos=True)
    drafts = {proposer: loaded[proposer]} if proposer in loaded else {}
    runner = bench.Bench(loaded["target"], settings, drafts, label="tiny")
    return runner.run("tiny-prompts", tiny_prompts(), bench.spec_configs([proposer], [4]))


def test_sampled_runs_are_checked_against_the_target_distribution(loaded, clock):
    records = sampled_bench(loaded, "other")
    assert all(r["audit"]["output"]["status"] == audit.VALID and "KS p" in r["audit"]["output"]["reason"]
               and len(r["sampled"]["u"]) == r["completion_tokens"] for r in records)  # the baselines too
    drafted = [r for r in records if r["spec"]]
    assert drafted and all(len(r["sampled"]["draft_lean"]) == len(audit.DRAFT_WEIGHTS)
                           and "towards the draft p" in r["audit"]["output"]["reason"] for r in drafted)
    assert all(r["speedup"] == pytest.approx(r["tok_s"] / r["baseline_tok_s"]) for r in records if r["spec"])
    row = report.summarize(records)[0]
    assert row.verdict.status == audit.VALID and "follow the target's distribution" in row.verdict.reason


def test_sampled_lookup_runs_are_checked_for_a_lean_towards_lookup(loaded, clock, monkeypatch):
    """Prompt lookup's runs get the test for a lean too; a verifier that keeps every lookup draft
    is refused."""
    from verispec import generate as engine
    from verispec.sampling import next_token
    from verispec.spec.verifier import Verdict

    honest = sampled_bench(loaded, "ngram")
    lookup_runs = [r for r in honest if r["spec"]]
    assert lookup_runs and all(r["sampled"]["draft_lean"] is not None for r in lookup_runs)
    assert report.summarize(honest)[0].verdict.status == audit.VALID
    real = engine.verify_sampling

    def trusting_verifier(logits, drafts, draft_probs, params, generator):
        if not drafts:
            return real(logits, drafts, draft_probs, params, generator)
        return Verdict(len(drafts), next_token(logits[len(drafts)], params, generator), bonus=True)

    monkeypatch.setattr(engine, "verify_sampling", trusting_verifier)
    assert report.summarize(sampled_bench(loaded, "ngram"))[0].verdict.status == audit.INVALID


def test_injected_sampling_that_keeps_every_draft_is_invalid(loaded, clock, monkeypatch):
    """A verifier that keeps every draft emits the draft's distribution, not the target's."""
    from verispec import generate as engine
    from verispec.sampling import next_token
    from verispec.spec.verifier import Verdict

    honest = engine.verify_sampling

    def trusting_verifier(logits, drafts, draft_probs, params, generator):
        if not drafts:  # a plain step
            return honest(logits, drafts, draft_probs, params, generator)
        return Verdict(len(drafts), next_token(logits[len(drafts)], params, generator), bonus=True)

    monkeypatch.setattr(engine, "verify_sampling", trusting_verifier)
    records = sampled_bench(loaded, "other")
    assert all(r["audit"]["status"] == audit.VALID for r in records if not r["spec"])
    assert any(r["audit"]["output"]["status"] == audit.INVALID for r in records if r["spec"])
    assert report.summarize(records)[0].verdict.status == audit.INVALID


# ---------------------------------------------------------------- bench on tiny models


def tiny_prompts(n: int = 2) -> list[Prompt]:
    return [Prompt(str(i), "default", text) for i, text in enumerate(PROMPTS[:n])]


def run_bench(loaded, proposers, gammas=(3,), settings=None) -> list[dict]:
    drafts = {"same": loaded["same"], "other": loaded["other"]}
    runner = bench.Bench(loaded["target"], settings or small_settings(repeats=2), drafts, label="tiny")
    return runner.run("tiny-prompts", tiny_prompts(), bench.spec_configs(list(proposers), list(gammas)))


def test_bench_records_are_complete_and_outputs_match(loaded):
    records = run_bench(loaded, ["same", "other", "ngram", "synthetic:1", "synthetic:0"])
    assert len(records) == 2 * 2 * 6  # repeats × prompts × (baseline + 5 configurations)
    for r in records:
        assert r["audit"]["output"]["status"] == audit.VALID
        assert r["audit"]["accounting"]["status"] == audit.VALID
        assert r["machine"]["torch"] == torch.__version__ and r["peak_rss_mb"] > 0
        assert r["model_bytes"] == loaded["target"].weight_bytes()
        if r["spec"]:
            assert r["target_passes"] == r["spec"]["rounds"]
            assert r["baseline_tok_s"] > 0 and r["speedup"] == pytest.approx(r["tok_s"] / r["baseline_tok_s"])
    by_proposer = {p: [r for r in records if r["proposer"] == p] for p in ("same", "synthetic:1", "synthetic:0")}
    assert all(r["spec"]["acceptance_rate"] == 1.0 for r in by_proposer["same"] + by_proposer["synthetic:1"])
    assert all(r["spec"]["accepted"] == 0 for r in by_proposer["synthetic:0"])


def test_injected_output_mismatch_is_invalid(loaded, clock, monkeypatch):
    from verispec import generate as engine
    from verispec.spec.verifier import Verdict

    def trusting_verifier(logits, drafts):  # a broken verifier that keeps every draft
        return Verdict(len(drafts), int(logits[len(drafts)].argmax()), bonus=True)

    monkeypatch.setattr(engine, "verify_greedy", trusting_verifier)
    records = run_bench(loaded, ["other"], settings=small_settings())
    spec_runs = [r for r in records if r["spec"]]
    assert spec_runs and all(r["audit"]["output"]["status"] == audit.INVALID for r in spec_runs)
    assert all(r["audit"]["output"]["margin"] > 1e-3 for r in spec_runs)  # a real difference, no tie
    # refused as a whole; on a busy machine a tiny baseline's few milliseconds can also make
    # the run's speed-up impossible, the worse verdict
    assert all(r["audit"]["status"] in (audit.INVALID, audit.IMPOSSIBLE) for r in spec_runs)
    rows = report.summarize(records)
    assert rows[0].verdict.status == audit.INVALID and rows[0].speedup is None  # left out of the speed-up


def test_injected_too_fast_timing_is_impossible(loaded, clock, monkeypatch):
    real_generate = bench.generate

    def slow_baseline(target, prompt, draft=None, **options):  # the target alone timed on a loaded machine
        clock.extra_s = 0.0 if draft is not None else 0.05
        try:
            return real_generate(target, prompt, draft=draft, **options)
        finally:
            clock.extra_s = 0.0

    monkeypatch.setattr(bench, "generate", slow_baseline)
    records = run_bench(loaded, ["synthetic:0"], settings=small_settings(max_tokens=8))
    spec_runs = [r for r in records if r["spec"]]
    assert all(r["audit"]["physics"]["status"] == audit.IMPOSSIBLE for r in spec_runs)
    assert "exceeds 1 + accepted drafts per pass = 1 + 0/" in spec_runs[0]["audit"]["reason"]
    assert report.summarize(records)[0].verdict.status == audit.IMPOSSIBLE


def test_honest_timings_pass_the_physics_rules(loaded, clock):
    records = run_bench(loaded, ["same", "other", "ngram", "synthetic:0.5", "synthetic:1"], gammas=(2, 6))
    assert [r["audit"]["status"] for r in records] == [audit.VALID] * len(records)
    rows = report.summarize(records)
    assert all(row.verdict.status == audit.VALID and row.excluded == 0 for row in rows)
    free = next(r for r in rows if r.proposer == "synthetic:1" and r.gamma == 6)
    assert free.acceptance == 1.0 and free.speedup > 2.0  # free drafts, all kept: several tokens per pass
    unrelated = next(r for r in rows if r.proposer == "other" and r.gamma == 6)
    assert unrelated.acceptance < 0.5 and unrelated.speedup < 1.0  # paying for drafts the target rejects


def test_bytes_per_pass_of_a_moe_target_count_only_active_experts(tmp_path):
    import transformers

    config = transformers.Qwen2MoeConfig(
        vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tiny.EOS_ID, bos_token_id=None,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tiny.randomize(model, 0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tiny.write_tokenizer(tmp_path)
    target = load_model(tmp_path)
    expert_bytes = 2 * 3 * 8 * 32 * 64 * 4  # layers × projections × experts × width × hidden × float32
    assert bench.bytes_read_per_pass(target) == target.weight_bytes() - expert_bytes * 6 // 8
    runner = bench.Bench(target, small_settings(max_tokens=8), label="moe")
    records = runner.run("p", tiny_prompts(1), bench.spec_configs(["synthetic:1", "synthetic:0"], [4]))
    assert all(r["audit"]["output"]["status"] == audit.VALID for r in records)
    assert [r["spec"]["acceptance_rate"] for r in records if r["spec"]] == [1.0, 0.0]


# ---------------------------------------------------------------- reports from JSONL alone


def fake_run(prompt_id: str, repeat: int, tok_s: float, proposer: str = "baseline", gamma: int = 0,
             accepted: int = 0, drafted: int = 0) -> dict:
    """A record as the bench writes it, with chosen numbers: 9 tokens, 5 passes for a speculative run."""
    spec = None
    passes = 9
    if proposer != "baseline":
        passes = 5
        spec = {"rounds": passes, "drafted": drafted, "accepted": accepted, "recovered": 8 - accepted, "bonus": 1,
                "accepted_by_position": [accepted], "drafted_by_position": [drafted],
                "acceptance_rate": accepted / drafted, "tokens_per_pass": 9 / passes, "draft_s": 0.1,
                "verify_s": 0.2}
    return {"key": f"{prompt_id}{proposer}{gamma}{repeat}", "target": "t", "weights": "float32",
            "prompt_set": "p", "prompt_id": prompt_id, "category": "c", "proposer": proposer,
            "proposer_kind": "baseline" if proposer == "baseline" else "draft", "gamma": gamma, "adaptive": False,
            "repeat": repeat, "completion_tokens": 9, "tok_s": tok_s, "target_passes": passes, "spec": spec,
            "time_split": {"draft_s": 0.08 if spec else 0.0, "target_s": 0.16, "other_s": 0.0},
            "origins": None, "audit": {"output": {"status": "VALID", "reason": ""}},
            "machine": {"processor": "test CPU", "threads": 2, "torch": "x", "device": "cpu"}}


def test_tables_and_plots_come_from_jsonl_alone(tmp_path, monkeypatch):
    records = []
    for repeat, (b1, b2) in enumerate([(10.0, 20.0), (12.0, 18.0), (11.0, 100.0)]):
        records += [fake_run("1", repeat, b1), fake_run("2", repeat, b2)]
    for repeat, (s1, s2) in enumerate([(15.0, 22.0), (16.0, 24.0), (17.0, 20.0)]):
        records += [fake_run("1", repeat, s1, "d", 4, accepted=4, drafted=8),
                    fake_run("2", repeat, s2, "d", 4, accepted=4, drafted=8)]
    path = tmp_path / "runs.jsonl"
    RecordWriter(path, fresh=True).write_all(records)

    def no_models(*args, **kwargs):
        raise AssertionError("a report must not load models")

    monkeypatch.setattr("verispec.loading.load_model", no_models)
    built = report.build_report(path, tmp_path / "out")
    row = built.rows[0]
    # prompt 1: median 16 / median 11; prompt 2: median 22 / median 20 (the slow outlier does not count)
    ratios = [16 / 11, 22 / 20]
    assert row.speedup == pytest.approx(statistics.median(ratios))
    assert (row.speedup_min, row.speedup_max) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    assert row.acceptance == 0.5 and row.tokens_per_pass == pytest.approx(9 / 5)
    text = built.markdown_path.read_text()
    assert "| Draft length γ | Baseline tok/s | Speculative tok/s | Speedup | Acceptance |" in text
    assert f"| 4 | 15.50 | 19.00 | {row.speedup:.2f}x ({min(ratios):.2f}–{max(ratios):.2f}) | 50.0% | 1.80 | VALID |" in text
    for name in report.PLOTS:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000


def test_report_shows_the_cost_model_prediction_with_a_profile(tmp_path, capsys):
    from verispec.lab.calibrate import CalibrationProfile, ModelTiming
    from verispec.lab.costmodel import alpha_from_counts, predict_speedup

    records = [fake_run("1", 0, 10.0), fake_run("1", 0, 15.0, "d", 4, accepted=4, drafted=8)]
    path = tmp_path / "runs.jsonl"
    RecordWriter(path, fresh=True).write_all(records)
    seconds = [0.10, 0.12, 0.13, 0.14, 0.15]
    profile = CalibrationProfile({"processor": "test"}, 1e10, 1e10, 1e11,
                                 ModelTiming("t", "float32", 64, [1, 2, 3, 4, 5], seconds),
                                 ModelTiming("d", "float32", 64, [1], [0.02]))
    profile.save(tmp_path / "profile.json")
    row = report.build_report(path, profile=tmp_path / "profile.json").rows[0]
    expected = predict_speedup(alpha_from_counts(4, 4), 4, 0.02 / 0.10, lambda m: seconds[m - 1] / seconds[0])
    assert row.predicted == pytest.approx(expected)
    code, out = run_cli(capsys, "report", path, "--out", tmp_path / "out", "--profile", tmp_path / "profile.json")
    assert code == 0 and "Predicted" in out and f"{expected:.2f}x" in out


def test_report_predicts_only_rows_of_the_draft_vocabulary_the_profile_timed(tmp_path):
    """A profile whose draft steps computed the first 64 ids' logits predicts the rows whose
    draft proposed those ids, not the whole vocabulary's, and the other way round."""
    from verispec.lab.calibrate import CalibrationProfile, ModelTiming

    records = [fake_run("1", 0, 10.0), fake_run("1", 0, 15.0, "d", 4, accepted=4, drafted=8),
               {**fake_run("1", 0, 16.0, "d", 4, accepted=4, drafted=8), "draft_vocab": 64, "key": "limited"}]
    path = tmp_path / "runs.jsonl"
    RecordWriter(path, fresh=True).write_all(records)
    target = ModelTiming("t", "float32", 64, [1, 2, 3, 4, 5], [0.10, 0.12, 0.13, 0.14, 0.15])
    for vocab in (None, 64):
        CalibrationProfile({"processor": "test"}, 1e10, 1e10, 1e11, target,
                           ModelTiming("d", "float32", 64, [1], [0.02], vocab=vocab)).save(tmp_path / "p.json")
        rows = report.build_report(path, profile=tmp_path / "p.json").rows
        predicted = {row.draft_vocab: row.predicted for row in rows}
        assert set(predicted) == {None, 64}
        assert all((value is not None) == (vocab == timed) for timed, value in predicted.items())


def test_report_prediction_charges_the_drafts_prompt_reading(tmp_path):
    """With the draft's prefill in the profile, each row pays for reading its prompts once."""
    from verispec.lab.calibrate import CalibrationProfile, ModelTiming
    from verispec.lab.costmodel import alpha_from_counts, predict_speedup

    records = [fake_run("1", 0, 10.0), fake_run("1", 0, 15.0, "d", 4, accepted=4, drafted=8)]
    for record in records:
        record["prompt_tokens"] = 100
    path = tmp_path / "runs.jsonl"
    RecordWriter(path, fresh=True).write_all(records)
    seconds = [0.10, 0.12, 0.13, 0.14, 0.15]
    target = ModelTiming("t", "float32", 64, [1, 2, 3, 4, 5], seconds)
    plain = CalibrationProfile({"processor": "test"}, 1e10, 1e10, 1e11, target,
                               ModelTiming("d", "float32", 64, [1, 2], [0.02, 0.03]))
    reading = CalibrationProfile({"processor": "test"}, 1e10, 1e10, 1e11, target,
                                 ModelTiming("d", "float32", 64, [1, 2], [0.02, 0.03], 0, [50, 200], [0.05, 0.2]))
    plain.save(tmp_path / "plain.json")
    reading.save(tmp_path / "reading.json")
    without = report.build_report(path, profile=tmp_path / "plain.json").rows[0].predicted
    with_reading = report.build_report(path, profile=tmp_path / "reading.json").rows[0].predicted
    # 100 prompt tokens take 0.1 s = 1 target step, spread over the 8 tokens after the first
    alpha, r = alpha_from_counts(4, 4), (lambda m: seconds[m - 1] / seconds[0])
    assert without == pytest.approx(predict_speedup(alpha, 4, 0.2, r, draft_r2=1.5))
    assert with_reading == pytest.approx(predict_speedup(alpha, 4, 0.2, r, draft_r2=1.5, prompt_cost=1 / 8))
    assert with_reading < without


def test_report_cli_reaudits_a_doctored_timing(tmp_path, capsys):
    records = [fake_run("1", 0, 10.0), fake_run("1", 0, 50.0, "d", 4, accepted=0, drafted=16)]
    path = tmp_path / "runs.jsonl"
    RecordWriter(path, fresh=True).write_all(records)
    code, out = run_cli(capsys, "report", path, "--out", tmp_path / "out")
    assert code == 1 and "IMPOSSIBLE" in out
    assert (tmp_path / "out" / "results.md").is_file()


# ---------------------------------------------------------------- sweep


class Killed(Exception):
    pass


def test_sweep_resumes_without_rerunning_finished_runs(models, prompt_file, tmp_path, monkeypatch):
    config = sweep.sweep_config_from_dict({
        "targets": [str(models / "target")], "proposers": ["ngram", "synthetic:0.5"], "gammas": [2, 3],
        "prompts": [str(prompt_file)], "limit": 2, "max_tokens": 6, "repeats": 1, "warmup": False,
        "out": str(tmp_path / "sweep.jsonl")})
    total = 2 * (1 + 4)  # prompts × (baseline + proposers × γ)

    def kill_after(n: int):
        seen = []

        def on_record(record: dict) -> None:
            seen.append(record)
            if len(seen) == n:
                raise Killed
        return on_record

    with pytest.raises(Killed):
        sweep.run_sweep(config, on_record=kill_after(4))
    assert len(read_records(config.out)) == 4
    with open(config.out, "a") as f:
        f.write('{"key": "torn')  # a write cut short by the kill
    resumed = sweep.run_sweep(config)
    assert (resumed.total, resumed.executed, resumed.skipped) == (total, total - 4, 4)
    keys = [r["key"] for r in read_records(config.out)]
    assert len(keys) == total == len(set(keys))

    monkeypatch.setattr(sweep, "load_for_bench", lambda *a, **k: pytest.fail("a finished sweep loads no model"))
    again = sweep.run_sweep(config)
    assert (again.executed, again.skipped) == (0, total)


def test_sweep_drafts_in_each_targets_format_unless_told(models, prompt_file, tmp_path):
    settings = {"targets": [str(models / "target")], "weights": ["float32", "int8"],
                "proposers": [str(models / "same")], "gammas": [2], "prompts": [str(prompt_file)], "limit": 1,
                "max_tokens": 4, "repeats": 1, "warmup": False}
    config = sweep.sweep_config_from_dict({**settings, "out": str(tmp_path / "follows.jsonl")})
    sweep.run_sweep(config)
    drafted = [(r["weights"], r["draft_weights"]) for r in read_records(config.out) if r["proposer_kind"] == "draft"]
    assert drafted == [("float32", "float32"), ("int8", "int8")]
    config = sweep.sweep_config_from_dict({**settings, "draft_weights": "int4", "out": str(tmp_path / "own.jsonl")})
    sweep.run_sweep(config)
    drafted = [(r["weights"], r["draft_weights"]) for r in read_records(config.out) if r["proposer_kind"] == "draft"]
    assert drafted == [("float32", "int4"), ("int8", "int4")]


def test_sweep_lookup_both_ways_runs_each_adaptive_draft_model_configuration_twice(models, tmp_path, clock):
    """`lookup: [true, false]` doubles only the configurations it means something to: the draft
    model's under the cost-aware schedule, not prompt lookup's own nor a fixed γ."""
    prompts = tmp_path / "repeating.txt"
    prompts.write_text("the cat sat on the mat. " * 4 + "\n")
    config = sweep.sweep_config_from_dict({
        "targets": [str(models / "target")], "proposers": [str(models / "same"), "ngram"], "gammas": [4],
        "adaptive": [False, "cost"], "lookup": [True, False], "prompts": [str(prompts)], "limit": 1,
        "max_tokens": 40, "ignore_eos": True, "chat": False, "repeats": 1, "warmup": False,
        "out": str(tmp_path / "lookup.jsonl")})
    assert [c.label.split(" ", 1)[1] for c in config.configs()] == [
        "γ=4 vocab=auto", "γ=4 adaptive=cost vocab=auto", "γ=4 adaptive=cost no-lookup vocab=auto", "γ=4",
        "γ=4 adaptive=cost"]
    sweep.run_sweep(config)
    runs = {(r["proposer_kind"], r["adaptive"], r["lookup"]): r for r in read_records(config.out)}
    assert runs[("draft", "cost", True)]["spec"]["lookup_drafted"] > 0
    assert runs[("draft", "cost", False)]["spec"]["lookup_drafted"] == 0
    assert len(runs) == 6 and all(r["audit"]["output"]["status"] == audit.VALID for r in runs.values())


def test_sweep_draft_vocab_runs_each_draft_model_configuration_with_each_vocabulary(models, tmp_path):
    """`draft_vocab: [null, 64]` doubles the draft model's configurations only; the limited
    runs say so in their records and rows, keep fewer drafts, and give the same output."""
    prompts = tmp_path / "cat.txt"
    prompts.write_text("the cat sat on the mat.\n")
    config = sweep.sweep_config_from_dict({
        "targets": [str(models / "target")], "proposers": [str(models / "same"), "ngram"], "gammas": [4],
        "draft_vocab": [None, 64], "prompts": [str(prompts)], "limit": 1, "max_tokens": 24,
        "ignore_eos": True, "chat": False, "repeats": 1, "warmup": False, "out": str(tmp_path / "vocab.jsonl")})
    assert [c.label.split(" ", 1)[1] for c in config.configs()] == ["γ=4", "γ=4 vocab=64", "γ=4"]
    sweep.run_sweep(config)
    records = read_records(config.out)
    runs = {(r["proposer_kind"], r["draft_vocab"]): r for r in records}
    assert set(runs) == {("baseline", None), ("draft", None), ("draft", 64), ("ngram", None)}
    whole, limited = runs[("draft", None)], runs[("draft", 64)]
    assert whole["token_ids"] == limited["token_ids"] and whole["key"] != limited["key"]
    assert limited["spec"]["accepted"] < whole["spec"]["accepted"]
    assert all(r["audit"]["output"]["status"] == audit.VALID for r in records)
    rows = report.summarize(records)
    assert sorted(r.schedule for r in rows if r.proposer_kind == "draft") == ["", " (vocab: 64)"]


def test_sweep_config_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("targets: [x]\nproposers: [ngram]\ngamas: [4]\n")
    with pytest.raises(VerispecError, match="unknown key"):
        sweep.load_sweep_config(path)
    path.write_text("targets: [x]\nproposers: [synthetic:2]\n")
    with pytest.raises(VerispecError, match="synthetic acceptance takes a probability"):
        sweep.load_sweep_config(path)


# ---------------------------------------------------------------- CLI: bench and the demo


def test_bench_cli(models, prompt_file, tmp_path, capsys, clock):
    out = tmp_path / "bench.jsonl"
    code, text = run_cli(capsys, "bench", "--model", models / "target", "--draft", models / "same", "ngram",
                         "--gamma", "2", "4", "--prompts", prompt_file, "--limit", "2", "--max-tokens", "8",
                         "--repeats", "1", "--no-warmup", "--out", out)
    assert code == 0
    assert len(read_records(out)) == 2 * (1 + 4)
    assert "Draft length γ" in text and "per run" in text


def test_the_draft_takes_the_targets_format_unless_told(models, prompt_file, tmp_path, capsys, clock, monkeypatch):
    """A draft left without --draft-weights is loaded in the target's --weights, by every command
    that loads one: a float32 draft beside a quantised target would cost about what the target does."""
    import verispec.loading

    formats, original = [], verispec.loading.load_model

    def load_model_and_note(*args, **kwargs):
        loaded = original(*args, **kwargs)
        formats.append(loaded.weights)
        return loaded

    monkeypatch.setattr(verispec.loading, "load_model", load_model_and_note)
    target, draft = models / "target", models / "same"
    generate = ["generate", "--model", target, "--draft", draft, "-n", "4", "--json", "hi"]
    assert run_cli(capsys, *generate, "--weights", "int8")[0] == 0
    assert run_cli(capsys, *generate, "--weights", "int8", "--draft-weights", "int4")[0] == 0
    assert run_cli(capsys, *generate)[0] == 0
    assert formats == ["int8", "int8", "int8", "int4", "float32", "float32"]

    out = tmp_path / "bench.jsonl"
    bench_args = ["bench", "--model", target, "--draft", draft, "--weights", "int4", "--gamma", "2", "--prompts",
                  prompt_file, "--limit", "1", "--max-tokens", "4", "--repeats", "1", "--no-warmup", "--out", out]
    assert run_cli(capsys, *bench_args)[0] == 0
    assert [(r["weights"], r["draft_weights"]) for r in read_records(out)] == [("int4", None), ("int4", "int4")]
    # resumed with the draft in another format: its run is another measurement, the baseline is reused
    assert run_cli(capsys, *bench_args, "--draft-weights", "int8")[0] == 0
    assert run_cli(capsys, *bench_args, "--draft-weights", "int8")[0] == 0
    records = read_records(out)
    assert [r["draft_weights"] for r in records] == [None, "int4", "int8"]
    assert len({r["key"] for r in records}) == 3
    lookup_only = [a if a != draft else "ngram" for a in bench_args]
    code, text = run_cli(capsys, *lookup_only, "--draft-weights", "int8")
    assert code == 1 and "no --draft here is a model" in text


def test_generate_prints_both_loads_and_the_speculative_counts(models, capsys):
    code, out = run_cli(capsys, "generate", "--model", models / "target", "--draft", models / "same", "-n", "9",
                        "--gamma", "4", "--ignore-eos", "--show", "hi")
    assert code == 0
    summary = " ".join(out.split())  # as one line, however the console wrapped it
    assert re.search(r"load \d+\.\d s \(draft \d+\.\d s\)", summary)
    # a draft equal to the target keeps everything: the prefill's token, 4 drafts + bonus, then
    # the 2 drafts the budget leaves room for + bonus
    assert "drafted 6, accepted 6 (100.0%), recovered 0, bonus 2, plain 1" in summary
    assert "legend:" in summary
    code, out = run_cli(capsys, "generate", "--model", models / "target", "--draft", "ngram", "-n", "4", "hi")
    assert code == 0 and "(draft" not in out  # prompt lookup loads nothing


def test_generate_json_carries_logprobs_when_asked(models, capsys):
    argv = ["generate", "--model", models / "target", "--draft", models / "other", "-n", "6", "--ignore-eos", "hi"]
    code, out = run_cli(capsys, *argv[:-1], "--json", "--logprobs", "2", argv[-1])
    assert code == 0
    logprobs = json.loads(out)["logprobs"]
    assert len(logprobs) == 6 and all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in logprobs)
    code, out = run_cli(capsys, *argv[:-1], "--logprobs", "2", argv[-1])
    assert code == 1 and "--logprobs is reported in the JSON output: add --json" in out
    code, out = run_cli(capsys, *argv[:-1], "--json", "--logprobs", "30", argv[-1])
    assert code == 1 and "--logprobs takes 0 to 20" in out


def test_generate_takes_a_logit_bias_stop_token_ids_and_min_tokens(models, loaded, capsys):
    from verispec.generate import generate

    argv = ["generate", "--model", models / "target", "--draft", models / "other", "-n", "6", "--ignore-eos",
            "--json", "hi"]
    code, out = run_cli(capsys, *argv)
    first = json.loads(out)["token_ids"][0]
    code, out = run_cli(capsys, *argv[:-1], "--logit-bias", f"{first}=-100", "--logit-bias", "7=2.5", argv[-1])
    assert code == 0
    biased = json.loads(out)["token_ids"]
    assert first not in biased
    assert biased == generate(loaded["target"], "hi", max_tokens=6, ignore_eos=True,
                              logit_bias={first: -100, 7: 2.5}).token_ids
    code, out = run_cli(capsys, *argv[:-1], "--logit-bias", "7=1", "--logit-bias", "7=2", argv[-1])
    assert code == 1 and "names a token id twice" in out
    code, out = run_cli(capsys, *argv[:-1], "--logit-bias", "7=100", "--stop-token-id", "7", argv[-1])
    assert code == 0 and json.loads(out)["token_ids"] == [] and json.loads(out)["finish_reason"] == "stop"
    code, out = run_cli(capsys, *argv[:-1], "--logit-bias", "7=100", "--stop-token-id", "7", "--min-tokens", "3",
                        argv[-1])
    held = json.loads(out)
    assert code == 0 and len(held["token_ids"]) == 3 and 7 not in held["token_ids"] and held["finish_reason"] == "stop"


def test_generate_scores_a_prompt_with_no_tokens(models, capsys):
    argv = ["generate", "--model", models / "target", "-n", "0", "the cat sat"]
    code, out = run_cli(capsys, *argv[:-1], "--json", "--prompt-logprobs", "1", argv[-1])
    assert code == 0
    result = json.loads(out)
    scored = result["prompt_logprobs"]
    assert result["token_ids"] == [] and len(scored) == result["prompt_tokens"] > 2
    assert scored[0] is None and all(lp["logprob"] <= 0 and len(lp["top"]) == 1 for lp in scored[1:])
    code, out = run_cli(capsys, *argv)
    assert code == 1 and "--max-tokens 0 generates nothing" in out
    code, out = run_cli(capsys, *argv[:-1], "--prompt-logprobs", "1", argv[-1])
    assert code == 1 and "--prompt-logprobs is reported in the JSON output: add --json" in out


def test_generate_no_lookup_keeps_adaptive_rounds_to_the_draft_model(models, capsys, clock):
    """--adaptive with a draft model sends prompt lookup's drafts where a repeating text has
    them; --no-lookup leaves them out. The tokens are the same either way."""
    argv = ["generate", "--model", models / "target", "--draft", models / "same", "--adaptive", "-n", "40",
            "--ignore-eos", "--json", "the cat sat on the mat. " * 4]
    runs = []
    for extra in ([], ["--no-lookup"]):
        code, out = run_cli(capsys, *argv[:-1], *extra, argv[-1])
        assert code == 0
        runs.append(json.loads(out))
    mixed, alone = runs
    assert mixed["spec"]["lookup_drafted"] > 0 and alone["spec"]["lookup_drafted"] == 0
    assert mixed["token_ids"] == alone["token_ids"]


def test_bench_cli_with_a_16_bit_cache_keeps_its_runs_apart(models, prompt_file, tmp_path, capsys, clock):
    """Runs over a bfloat16 cache say so, and a results file resumed with another cache type
    runs them again rather than reusing the float32 ones."""
    out = tmp_path / "bench.jsonl"
    argv = ["bench", "--model", models / "target", "--draft", "ngram", "--gamma", "2", "--prompts", prompt_file,
            "--limit", "1", "--max-tokens", "8", "--repeats", "1", "--no-warmup", "--out", out]
    assert run_cli(capsys, *argv)[0] == 0
    assert run_cli(capsys, *argv, "--kv-cache", "bfloat16")[0] == 0
    records = read_records(out)
    assert [r["kv_cache"] for r in records] == ["float32"] * 2 + ["bfloat16"] * 2
    assert len({r["key"] for r in records}) == 4
    assert all(r["audit"]["output"]["status"] == audit.VALID for r in records)


def test_demo_end_to_end_on_tiny_models(models, prompt_file, tmp_path, capsys, clock):
    out = tmp_path / "demo.jsonl"
    code, text = run_cli(capsys, "demo", "--model", models / "target", "--draft", models / "same",
                         "--prompts", prompt_file, "--limit", "2", "--max-tokens", "8", "--out", out)
    records = read_records(out)
    assert len(records) == 2 * 3  # prompts × (baseline, draft model, prompt lookup)
    assert all(r["audit"]["output"]["status"] == audit.VALID for r in records)
    assert "audited results" in text and "kept draft" in text and "Draft length γ" in text
    rows = report.summarize(records)
    assert {r.proposer for r in rows} == {str(models / "same"), "ngram"}
    assert code == 0 and all(r.verdict.status == audit.VALID for r in rows)


# ---------------------------------------------------------------- CLI: bad input, one line, nothing lost


def run_cli_lines(capsys, *argv) -> tuple[int, str, list[str]]:
    """Exit code, standard output and the lines of standard error; never a traceback."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse exits for bad option values
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err.strip().splitlines()


def assert_one_line_error(code: int, err: list[str], *fragments: str) -> None:
    assert code == 1 and len(err) == 1 and err[0].startswith("verispec: error: ")
    assert all(fragment in err[0] for fragment in fragments), err[0]


def test_bench_no_lookup_keeps_adaptive_rounds_to_the_draft_model_and_its_runs_apart(models, tmp_path, capsys,
                                                                                     clock):
    """`verispec bench --adaptive --no-lookup`: the runs send none of prompt lookup's drafts, say
    so in their records and their row, and do not reuse the runs made with lookup."""
    prompts = tmp_path / "repeating.txt"
    prompts.write_text("the cat sat on the mat. " * 4 + "\n")
    out = tmp_path / "bench.jsonl"
    argv = ["bench", "--model", models / "target", "--draft", models / "same", "--gamma", "4", "--adaptive",
            "--prompts", prompts, "--limit", "1", "--max-tokens", "40", "--ignore-eos", "--repeats", "1",
            "--no-warmup", "--no-chat", "--out", out]
    assert run_cli(capsys, *argv)[0] == 0
    code, printed = run_cli(capsys, *argv, "--no-lookup")
    assert code == 0 and "(adaptive: cost, no lookup)" in " ".join(printed.split())
    with_lookup, without = [r for r in read_records(out) if r["proposer_kind"] == "draft"]
    assert with_lookup["lookup"] and with_lookup["spec"]["lookup_drafted"] > 0
    assert not without["lookup"] and without["spec"]["lookup_drafted"] == 0
    assert with_lookup["key"] != without["key"] and with_lookup["token_ids"] == without["token_ids"]
    assert without["audit"]["output"]["status"] == audit.VALID


def test_bench_draft_vocab_benches_each_vocabulary_named(models, prompt_file, tmp_path, capsys, clock):
    """`verispec bench --draft-vocab all 64`: the draft model's runs with the whole vocabulary
    and with the first 64 ids (and the context's), apart in the records and the table."""
    out = tmp_path / "bench.jsonl"
    code, printed = run_cli(capsys, "bench", "--model", models / "target", "--draft", models / "same", "--gamma", "3",
                            "--draft-vocab", "all", "64", "--prompts", prompt_file, "--limit", "1",
                            "--max-tokens", "12", "--repeats", "1", "--no-warmup", "--out", out)
    assert code == 0 and "(vocab: 64)" in " ".join(printed.split())
    vocabularies = [r["draft_vocab"] for r in read_records(out) if r["proposer_kind"] == "draft"]
    assert vocabularies == [None, 64]


def test_bench_draft_vocab_auto_is_the_default_and_records_its_number(models, prompt_file, tmp_path, capsys,
                                                                        clock, monkeypatch):
    """Without --draft-vocab a draft model proposes what "auto" gives its vocabulary (here the
    first 64 of 262 ids), and its records say so; its runs are not those of an explicit 64."""
    monkeypatch.setattr("verispec.spec.draft_model.AUTO_DRAFT_VOCAB", 64)
    out = tmp_path / "bench.jsonl"
    options = ["bench", "--model", models / "target", "--draft", models / "same", "--gamma", "3", "--prompts",
               prompt_file, "--limit", "1", "--max-tokens", "12", "--repeats", "1", "--no-warmup", "--out", out]
    code, printed = run_cli(capsys, *options)
    assert code == 0 and "(vocab: 64)" in " ".join(printed.split())
    code, _ = run_cli(capsys, *options, "--draft-vocab", "64", "all")
    records = [r for r in read_records(out) if r["proposer_kind"] == "draft"]
    assert code == 0 and [r["draft_vocab"] for r in records] == [64, 64, None]
    assert len({r["key"] for r in records}) == 3
    assert records[0]["token_ids"] == records[1]["token_ids"] == records[2]["token_ids"]


@pytest.mark.parametrize("bad_option, message", [
    (["--gamma", "33"], "expected a number from 1 to 32, got 33"),
    (["--ngram", "1", "3"], "MIN <= MAX"),
    (["--no-lookup", "--adaptive"], "no --draft here is a model"),
    (["-d", "some-draft", "--no-lookup"], "--adaptive cost is not on"),
    (["--draft-vocab", "1000"], "no --draft here is a model"),
    (["-d", "some-draft", "--draft-vocab", "0"], "expected a number of token ids, 'auto' or 'all', got '0'"),
])
def test_bench_refuses_a_bad_option_before_touching_the_results_file(models, prompt_file, tmp_path, capsys,
                                                                    monkeypatch, bad_option, message):
    monkeypatch.setattr("verispec.lab.bench.load_for_bench", lambda *a, **k: pytest.fail("no model should load"))
    out = tmp_path / "keep.jsonl"
    out.write_text('{"precious": 1}\n')
    code, _, err = run_cli_lines(capsys, "bench", "-m", models / "target", "-d", "ngram", "-p", prompt_file,
                                 "--limit", "1", "-n", "2", "-r", "1", "--out", out, *bad_option)
    assert code in (1, 2) and err[0].startswith("verispec: error: ") and message in err[0]
    assert out.read_text() == '{"precious": 1}\n'


def test_bench_out_naming_a_folder_is_an_error_before_loading(models, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("verispec.lab.bench.load_for_bench", lambda *a, **k: pytest.fail("no model should load"))
    code, _, err = run_cli_lines(capsys, "bench", "-m", models / "target", "-d", "ngram", "-p", prompt_file,
                                 "--limit", "1", "--out", tmp_path)
    assert_one_line_error(code, err, str(tmp_path), "is a folder")


def test_bench_appends_to_an_existing_results_file_and_resumes(models, prompt_file, tmp_path, capsys, clock):
    out = tmp_path / "runs.jsonl"
    out.write_text('{"precious": 1}')  # a record without its final newline is a record all the same
    argv = ["bench", "-m", models / "target", "-d", "ngram", "-g", "2", "3", "-p", prompt_file, "--limit", "1",
            "-n", "4", "-r", "1", "--no-warmup", "--out", out]
    code, _, _ = run_cli_lines(capsys, *argv)
    records = read_records(out)
    assert code == 0 and records[0] == {"precious": 1} and len(records) == 1 + 3
    code, text, _ = run_cli_lines(capsys, *argv)
    assert code == 0 and read_records(out) == records and "reused" in text
    code, _, _ = run_cli_lines(capsys, *argv, "--restart")
    assert code == 0 and len(read_records(out)) == 3 and {"precious": 1} not in read_records(out)


def test_audit_cli_shows_a_zero_baseline_as_invalid(tmp_path, capsys):
    path = tmp_path / "a1.csv"
    path.write_text("baseline_tok_s,spec_tok_s,gamma,acceptance\n0,10,4,0.5\n")
    code, out, err = run_cli_lines(capsys, "audit", path)
    assert code == 1 and not err and "INVALID" in out


@pytest.mark.parametrize("name, content, message", [
    ("a2.jsonl", b"[1,2]\n", ":1: not a JSON object"),
    ("a3.jsonl", b'{"gamma": 4}\n{"gamma": "\xff"}\n', ":2: not UTF-8"),
    ("a3.csv", b"baseline_tok_s,spec_tok_s,gamma,acceptance\n10,12,4,0.5\xff\n", ":2: not UTF-8"),
    ("a4.csv", b"baseline_tok_s,spec_tok_s,gamma,acceptance\n10,12,4,0.5,9\n", ":2: more values than the header"),
])
def test_audit_cli_names_the_file_and_line_of_an_unreadable_row(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    code, _, err = run_cli_lines(capsys, "audit", path)
    assert_one_line_error(code, err, f"{path}{message}")


def test_report_of_a_results_file_without_suffix_writes_beside_it(tmp_path, capsys):
    records = [fake_run("1", 0, 10.0), fake_run("1", 0, 15.0, "d", 4, accepted=4, drafted=8)]
    path = tmp_path / "runs"
    RecordWriter(path).write_all(records)
    code, _, _ = run_cli_lines(capsys, "report", path)
    assert code == 0 and (tmp_path / "runs-report" / "results.md").is_file()
    assert read_records(path) == records
    code, _, err = run_cli_lines(capsys, "report", path, "--out", path)
    assert_one_line_error(code, err, "a file is in the way")


@pytest.mark.parametrize("line, message", [
    ('{"a": 1}', "no field 'target'"),
    ("[1, 2]", "not a JSON object"),
    ('{"target": "t", "weights": "w", "prompt_set": "p", "prompt_id": "1", "proposer": "baseline", "gamma": 0, '
     '"tok_s": "fast", "completion_tokens": 9}', "field 'tok_s' holds text, expected a number"),
])
def test_report_names_the_file_and_line_of_a_record_that_is_not_a_run(tmp_path, capsys, line, message):
    path = tmp_path / "r1.jsonl"
    path.write_text(json.dumps(fake_run("1", 0, 10.0)) + "\n" + line + "\n")
    code, _, err = run_cli_lines(capsys, "report", path, "--out", tmp_path / "out")
    assert_one_line_error(code, err, f"{path}:2: {message}")


# ---------------------------------------------------------------- sweep and demo: bad input, nothing lost


@pytest.fixture(scope="module")
def mismatched_draft(tmp_path_factory):
    """A tiny model whose tokenizer swaps the ids of 'a' and 'b': no draft for the `models` target."""
    folder = tmp_path_factory.mktemp("mismatched")
    tiny.save_hf_model(folder, "qwen2", seed=3, max_position_embeddings=2048)
    tokenizer_file = folder / "tokenizer.json"
    swapped = (tokenizer_file.read_text().replace('"a":', '"TMP":').replace('"b":', '"a":')
               .replace('"TMP":', '"b":'))
    tokenizer_file.write_text(swapped)
    return folder


def write_sweep_yaml(path: Path, **lines: str) -> Path:
    """A sweep configuration from YAML snippets per key, so that a test can write a value of any type."""
    path.write_text("".join(f"{key}: {value}\n" for key, value in lines.items()))
    return path


@pytest.mark.parametrize("case, message", [
    ("missing model", "no model at 'nosuchmodel'"),
    ("missing prompts", "no prompts at"),
    ("draft with another tokenizer", "the draft's tokenizer does not match"),
    ("out is the config", "is the sweep configuration itself"),
])
def test_sweep_restart_keeps_earlier_results_when_a_check_fails(models, prompt_file, mismatched_draft, tmp_path,
                                                                capsys, case, message):
    out = tmp_path / "runs.jsonl"
    out.write_text('{"precious": 1}\n')
    lines = {"targets": f"[{models / 'target'}]", "proposers": "[ngram]", "prompts": f"[{prompt_file}]",
             "max_tokens": "4", "out": str(out)}
    if case == "missing model":
        lines["targets"] = "[nosuchmodel]"
    elif case == "missing prompts":
        lines["prompts"] = f"[{tmp_path / 'missing.txt'}]"
    elif case == "draft with another tokenizer":
        lines["proposers"] = f"[{mismatched_draft}]"
    config = write_sweep_yaml(tmp_path / "grid.yaml", **lines)
    if case == "out is the config":
        out = config
    kept = out.read_text()
    code, _, err = run_cli_lines(capsys, "sweep", config, "--out", out, "--restart")
    assert_one_line_error(code, err, message)
    assert out.read_text() == kept


@pytest.mark.parametrize("bad_option, message", [
    (["--gamma", "100"], "expected a number from 1 to 32, got 100"),
    (["--gamma", "0"], "expected a number >= 1, got 0"),
    (["--draft", "MISMATCHED"], "the draft's tokenizer does not match"),
])
def test_demo_keeps_the_results_file_when_its_input_is_bad(models, prompt_file, mismatched_draft, tmp_path, capsys,
                                                           bad_option, message):
    out = tmp_path / "keep.jsonl"
    out.write_text('{"precious": 1}\n')
    bad_option = [str(mismatched_draft) if part == "MISMATCHED" else part for part in bad_option]
    code, _, err = run_cli_lines(capsys, "demo", "--model", models / "target", "--draft", models / "same",
                                 "--prompts", prompt_file, "--limit", "1", "--max-tokens", "4", "--out", out,
                                 *bad_option)
    assert code in (1, 2) and err[0].startswith("verispec: error: ") and message in err[0], err
    assert out.read_text() == '{"precious": 1}\n'


@pytest.mark.parametrize("key, value", [
    ("limit", "abc"), ("limit", "0"), ("prompts", "5"), ("prompts", "[]"), ("out", "5"), ("threads", "many"),
    ("targets", "{a: 1}"), ("targets", "[]"), ("temperature", "hot"), ("temperature", "-1"),
    ("temperature", ".nan"), ("seed", "x"), ("ngram", "3"), ("ngram", "[1, 3]"), ("slack", "x"), ("slack", "2"),
    ("bandwidth_gb_s", "fast"), ("gammas", "[1000]"), ("gammas", "[0]"), ("gammas", "[]"), ("gammas", "[true]"),
    ("weights", "[]"), ("weights", "[int3]"), ("adaptive", "[0]"), ("max_tokens", "1"), ("warmup", "maybe"),
    ("lookup", "[]"), ("lookup", "[1]"), ("draft_vocab", "[0]"), ("draft_vocab", "[many]"), ("draft_vocab", "[]"),
])
def test_sweep_config_value_of_the_wrong_type_is_one_line_before_any_model_loads(models, prompt_file, tmp_path,
                                                                                 capsys, monkeypatch, key, value):
    monkeypatch.setattr(sweep, "load_for_bench", lambda *a, **k: pytest.fail("no model should load"))
    lines = {"targets": f"[{models / 'target'}]", "proposers": "[ngram]", "prompts": f"[{prompt_file}]",
             "out": str(tmp_path / "runs.jsonl"), key: value}
    config = write_sweep_yaml(tmp_path / "grid.yaml", **lines)
    code, _, err = run_cli_lines(capsys, "sweep", config)
    assert_one_line_error(code, err, str(config), f"'{key}' must be")
    assert not (tmp_path / "runs.jsonl").exists()


def test_bench_restart_keeps_earlier_results_when_the_draft_does_not_fit(models, prompt_file, mismatched_draft,
                                                                         tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    out.write_text('{"precious": 1}\n')
    code, _, err = run_cli_lines(capsys, "bench", "-m", models / "target", "-d", mismatched_draft, "-p", prompt_file,
                                 "--limit", "1", "-n", "2", "-r", "1", "--no-warmup", "--out", out, "--restart")
    assert_one_line_error(code, err, "the draft's tokenizer does not match")
    assert out.read_text() == '{"precious": 1}\n'  # --restart discards only when a new record is written
