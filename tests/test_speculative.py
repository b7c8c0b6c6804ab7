"""Speculative decoding never changes the answer: greedy equality, lossless sampling, stops, accounting."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import tiny
from verispec.errors import TokenizerMismatchError, VerispecError
from verispec.events import Token
from verispec.generate import generate, stream
from verispec.loading import load_model
from verispec.sampling import greedy_token, greedy_tokens
from verispec.spec.prompt_lookup import PromptLookupProposer

PROMPT = "the cat sat on the mat. the cat sat on the"
GAMMAS = list(range(1, 17))


@pytest.fixture(scope="module")
def baseline(target):
    return generate(target, PROMPT, max_tokens=40, ignore_eos=True)


def assert_accounting(result):
    spec = result.spec
    assert len(result.token_ids) == spec.accepted + spec.recovered + spec.bonus + spec.plain
    assert spec.rounds == len(spec.gammas)  # one target pass per round
    assert sum(spec.gammas) == spec.drafted
    assert sum(spec.accepted_by_position) == spec.accepted
    assert result.origins.count("draft") == spec.accepted
    assert result.origins.count("recovered") == spec.recovered
    assert result.origins.count("bonus") == spec.bonus  # only after a round whose drafts were all kept
    assert result.origins.count("target") == spec.plain == spec.gammas.count(0)  # the prefill's token included


@pytest.mark.parametrize("gamma", GAMMAS)
def test_draft_equal_to_target_keeps_every_draft(target, baseline, gamma):
    result = generate(target, PROMPT, draft=target, gamma=gamma, max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert result.spec.recovered == 0 and result.spec.acceptance_rate == 1.0
    assert_accounting(result)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_unrelated_draft_changes_nothing(target, unrelated, baseline, gamma):
    result = generate(target, PROMPT, draft=unrelated, gamma=gamma, max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert result.spec.acceptance_rate < 0.5 and result.spec.recovered > 0
    assert_accounting(result)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_prompt_lookup_changes_nothing(target, baseline, gamma):
    result = generate(target, PROMPT, draft="ngram", gamma=gamma, max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert result.spec.drafted > 0
    assert_accounting(result)


@pytest.mark.parametrize("policy", ["cost", "heuristic"])
@pytest.mark.parametrize("draft_kind", ["self", "unrelated", "ngram"])
def test_adaptive_gamma_changes_nothing(target, unrelated, baseline, policy, draft_kind):
    draft = {"self": target, "unrelated": unrelated, "ngram": "ngram"}[draft_kind]
    result = generate(target, PROMPT, draft=draft, gamma=4, adaptive=policy, max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert len(set(result.spec.gammas[1:])) > 1  # γ really moved
    assert_accounting(result)


def test_prompt_lookup_finds_the_latest_match():
    lookup = PromptLookupProposer(max_ngram=2, bounded_by_match=False)
    assert lookup.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert lookup.lookup([7, 8, 9], 3) == []


def test_eos_inside_a_kept_run_ends_where_baseline_ends(target, baseline):
    eos = baseline.token_ids[9]  # make a token the baseline emits the end-of-text token
    first = baseline.token_ids.index(eos)
    model = dataclasses.replace(target, tokenizer=_with_eos(target.tokenizer, eos))
    plain = generate(model, PROMPT, max_tokens=40)
    assert plain.token_ids == baseline.token_ids[:first] and plain.finish_reason == "eos"
    for gamma in (3, 8, 16):
        result = generate(model, PROMPT, draft=model, gamma=gamma, max_tokens=40)
        assert result.token_ids == plain.token_ids and result.finish_reason == "eos"
        assert_accounting(result)


def test_nothing_ends_the_text_before_min_tokens(target, baseline):
    """The end-of-text token, a stop token id and a stop string all come before token 12; with
    min_tokens=12 none of them ends the text there, plainly or speculatively."""
    eos, stop_id = baseline.token_ids[2], baseline.token_ids[5]
    model = dataclasses.replace(target, tokenizer=_with_eos(target.tokenizer, eos))
    options = dict(max_tokens=30, stop_token_ids=[stop_id], stop=[baseline.text[4:6]])
    assert generate(model, PROMPT, **options).token_ids == baseline.token_ids[:2]
    plain = generate(model, PROMPT, min_tokens=12, **options)
    assert len(plain.token_ids) >= 12 and not {eos, stop_id} & set(plain.token_ids[:12])
    # the first 12 are the target's choices with the two ids ruled out, and no stop string cut them
    ruled_out = generate(target, PROMPT, max_tokens=12, ignore_eos=True, logit_bias={eos: -100, stop_id: -100})
    assert plain.token_ids[:12] == ruled_out.token_ids
    for draft in (model, "ngram"):
        result = generate(model, PROMPT, draft=draft, gamma=4, min_tokens=12, **options)
        assert result.token_ids == plain.token_ids and result.finish_reason == plain.finish_reason
        if draft is model:  # the draft holds the ends off as the target does, so none is rejected
            assert result.spec.accepted == result.spec.drafted > 0
    for draft in (None, model):  # sampled, the two ids made likely: none before token 12, then soon
        lengths = []
        for seed in range(5):
            sampled = generate(model, PROMPT, draft=draft, gamma=4, min_tokens=12, temperature=1.5, top_p=0.9,
                               seed=seed, logit_bias={eos: 8.0, stop_id: 8.0}, **options)
            assert len(sampled.token_ids) >= 12 and not {eos, stop_id} & set(sampled.token_ids[:12])
            lengths.append(len(sampled.token_ids))
        assert min(lengths) == 12


def _with_eos(tokenizer, eos):
    clone = type(tokenizer).__new__(type(tokenizer))
    clone.__dict__.update(tokenizer.__dict__)
    clone.eos_ids = {eos}
    return clone


def test_stop_string_inside_a_kept_run(target, baseline):
    stop = baseline.text[12:15]
    plain = generate(target, PROMPT, max_tokens=40, ignore_eos=True, stop=[stop])
    assert plain.finish_reason == "stop" and stop not in plain.text
    assert plain.text == baseline.text[: baseline.text.index(stop)]
    for gamma in (4, 16):
        result = generate(target, PROMPT, draft=target, gamma=gamma, max_tokens=40, ignore_eos=True, stop=[stop])
        assert result.text == plain.text and result.token_ids == plain.token_ids
        assert_accounting(result)


def test_a_stop_token_id_ends_the_text_before_it(target, baseline):
    stop = baseline.token_ids[9]
    first = baseline.token_ids.index(stop)
    for draft in (None, target, "ngram"):
        result = generate(target, PROMPT, draft=draft, gamma=4, max_tokens=40, ignore_eos=True,
                          stop_token_ids=[stop])
        assert result.token_ids == baseline.token_ids[:first] and result.finish_reason == "stop"
        if draft is target:  # every round drafted (a plain round that stops emits nothing)
            assert_accounting(result)


def test_streamed_text_never_shows_the_stop_string(target, baseline):
    stop = baseline.text[12:15]
    pieces, tail = [], None
    for event in stream(target, PROMPT, draft=target, gamma=8, max_tokens=40, ignore_eos=True, stop=[stop]):
        if isinstance(event, Token):
            pieces.append(event.text)
        else:
            tail = event.tail
    assert "".join(pieces) + tail == baseline.text[: baseline.text.index(stop)]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 17])
def test_max_tokens_is_never_exceeded(target, baseline, max_tokens):
    for draft in (target, "ngram"):
        result = generate(target, PROMPT, draft=draft, gamma=16, max_tokens=max_tokens, ignore_eos=True)
        assert result.token_ids == baseline.token_ids[:max_tokens]
        assert result.finish_reason == "length"


def test_mismatched_draft_tokenizer_is_refused(tmp_path, target):
    from tokenizers import Tokenizer
    tiny.save_hf_model(tmp_path, "qwen2", seed=3)
    backend = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = backend.get_vocab()
    raw = backend.to_str().replace('"a":', '"TMP":').replace('"b":', '"a":').replace('"TMP":', '"b":')
    (tmp_path / "tokenizer.json").write_text(raw)
    draft = load_model(tmp_path)
    with pytest.raises(TokenizerMismatchError, match=rf"token id {vocab['a']} is 'a' for the target but 'b'"):
        generate(target, PROMPT, draft=draft)


def test_padded_draft_vocabulary_is_accepted(tmp_path, target, baseline):
    tiny.save_hf_model(tmp_path, "qwen2", seed=4, vocab_size=tiny.VOCAB + 38)  # padding rows only
    draft = load_model(tmp_path)
    result = generate(target, PROMPT, draft=draft, gamma=4, max_tokens=40, ignore_eos=True)
    assert result.token_ids == baseline.token_ids


# ------------------------------------------------------------------ sampling is lossless

def test_greedy_tokens_are_torch_argmax_including_ties():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    logits[1, 7] = logits[1, 900] = logits[1].max() + 1  # a tie: the first index wins, as in torch
    logits[2, :] = 0.0
    assert greedy_tokens(logits) == logits.argmax(-1).tolist()
    assert greedy_tokens(logits)[1:3] == [7, 0]
    sliced = logits[:, :600]  # rows of a view, as a draft's logits cut to the target's vocabulary
    assert greedy_tokens(sliced) == sliced.argmax(-1).tolist()
    assert [greedy_token(row) for row in logits] == logits.argmax(-1).tolist()
    halves = logits.to(torch.bfloat16)  # other types take torch's own argmax
    assert greedy_tokens(halves) == halves.argmax(-1).tolist()


def test_speculative_sampling_follows_the_target_distribution():
    from verispec.sampling import SamplingParams
    options = dict(temperature=0.9, top_k=5, top_p=0.97)  # every warp, on both models
    target, draft = tiny.tiny_lm(6, seed=10), tiny.tiny_lm(6, seed=11)
    prompt = [1, 2, 3]
    exact = tiny.exact_distribution(target, prompt, 3, SamplingParams(**options))
    counts = dict.fromkeys(exact, 0)
    samples = 20_000
    generator_seed = 1234
    for i in range(samples):
        result = generate(target, prompt, draft=draft, gamma=2, max_tokens=3, seed=generator_seed + i, **options)
        counts[tuple(result.token_ids)] += 1
    p_value, cells = tiny.goodness_of_fit(exact, counts)
    assert cells >= 10 and p_value > 0.01


def test_speculative_sampling_with_a_limited_draft_vocabulary_follows_the_target_distribution():
    """A draft that proposes only the first 2 of 6 ids and the context's (the prompt's 5 and 4,
    then whatever the answer adds) still gives the target's distribution: its probabilities
    are zero on the ids it cannot propose, and the verifier draws the rest from the residual."""
    from verispec.sampling import SamplingParams
    from verispec.spec.draft_model import DraftModelProposer
    target, draft = tiny.tiny_lm(6, seed=10), tiny.tiny_lm(6, seed=11)
    prompt = [1, 5, 4]  # ids whose logits' columns (2, 3) are not their own
    exact = tiny.exact_distribution(target, prompt, 3, SamplingParams(temperature=0.9))
    counts = dict.fromkeys(exact, 0)
    samples = 8_000
    for i in range(samples):
        proposer = DraftModelProposer(draft, vocab_limit=2, markdown=False)  # only the context's ids above 2
        result = generate(target, prompt, draft=proposer, gamma=2, max_tokens=3, seed=4321 + i, temperature=0.9)
        counts[tuple(result.token_ids)] += 1
    assert proposer.extra_ids[:2] == [5, 4]  # the prompt's ids at or above the limit, proposed too
    p_value, cells = tiny.goodness_of_fit(exact, counts)
    assert cells >= 10 and p_value > 0.01


def test_verifier_alone_is_lossless_for_a_one_hot_draft():
    """Prompt lookup has no probabilities: the draft counts as one-hot."""
    from scipy.stats import chisquare

    from verispec.sampling import SamplingParams
    from verispec.spec.verifier import verify_sampling
    logits = torch.tensor([[1.0, 0.5, -0.3, 0.2], [0.0, 0.1, 0.2, 0.3]])
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 4
    for _ in range(20_000):
        verdict = verify_sampling(logits, [2], None, params, gen)
        counts[2 if verdict.accepted else verdict.token] += 1
    expected = torch.softmax(logits[0].double(), -1) * sum(counts)
    assert chisquare(counts, expected.tolist()).pvalue > 0.01


def probes_while_drafts_fail(policy, rounds: int = 2000) -> list[int]:
    """The rounds in which `policy` speculates when every draft is rejected, after a plain step
    of 10 ms and three failed rounds (a draft step costs 4 ms, each verified position 1 ms)."""
    policy.update(0, 0, 0.0, 0.010)
    for _ in range(3):
        policy.update(4, 0, 0.016, 0.013)
    probes = []
    for i in range(rounds):
        gamma = policy.choose()
        if gamma > 0:
            probes.append(i)
        policy.update(gamma, 0, 0.004 * gamma, 0.010 + 0.001 * gamma)
    return probes


def test_cost_aware_policy_falls_back_and_probes_ever_more_rarely():
    from verispec.spec.gamma import CostAwareGamma
    probes = probes_while_drafts_fail(CostAwareGamma())
    assert 3 <= len(probes) <= 8  # intervals 64, 128, 256, 512, 512, ...: well under 1% of rounds
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps)  # backing off


def test_quick_reprobe_trial_probes_soon_after_giving_up_then_ever_more_rarely(monkeypatch):
    """benchmarks/adaptive_split.py's `quick-reprobe` trial: the first probe after speculation is
    given up comes after QUICK_REPROBE plain rounds, and the waits double from there to the
    engine's longest."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")
    policy = adaptive_split.quick_reprobe_policy(16)
    probes = probes_while_drafts_fail(policy)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == adaptive_split.QUICK_REPROBE - 1
    assert gaps[:4] == [16, 32, 64, 128] and max(gaps) == 8 * policy.probe_every


def test_probe_budget_trial_waits_for_plain_steps_worth_the_last_probes_loss(monkeypatch):
    """benchmarks/adaptive_split.py's `probe-budget` trial: once speculation is given up, the
    next probe comes when the plain steps since the last speculative round cost that round's
    loss (catch-up reading, drafts and pass, less the plain steps its one token saved) over
    PROBE_SHARE: a probe that read 50 ms of context waits six times as long as one that read
    none, and each failed probe costs no more than that share of the plain steps after it."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")

    def probes(reading_s: float) -> tuple[list[int], float, list[float]]:
        policy = adaptive_split.probe_budget_policy(16)
        policy.update(0, 0, 0.0, 0.010)  # plain steps of 10 ms
        policy.update(2, 0, 0.008, 0.012)  # a failed first round: draft steps of 4 ms
        rounds, plain_s, lost = [], 0.0, []
        for i in range(400):
            gamma = policy.choose()
            if gamma:
                adaptive_split.TimedReadingProposer.unread_s = reading_s  # what a catch-up would leave
                rounds.append(i)
                lost.append(reading_s + 0.004 * gamma + 0.010 + 0.001 * gamma - 0.010)
            else:
                plain_s += 0.010
            policy.update(gamma, 0, 0.004 * gamma, 0.010 + 0.001 * gamma)
        return rounds, plain_s, lost

    cheap, dear = probes(0.0), probes(0.05)
    cheap_gaps = {b - a for a, b in zip(cheap[0], cheap[0][1:])}
    dear_gaps = {b - a for a, b in zip(dear[0], dear[0][1:])}
    assert cheap_gaps == {11} and dear_gaps == {61}  # 0.1 s and 0.6 s of plain steps, then the probe
    for _, plain_s, lost in (cheap, dear):  # the last probe's plain steps may run past the end
        assert sum(lost[:-1]) <= adaptive_split.PROBE_SHARE * plain_s < sum(lost) + 0.01


def test_plain_budget_trial_counts_only_plain_steps_towards_the_wait(monkeypatch):
    """benchmarks/adaptive_split.py's `plain-budget` trial waits as `probe-budget` does, but
    prompt lookup's rounds between probes do not bring the next probe nearer."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")

    def plain_steps_before_probe(variant: str, lookup_rounds: bool) -> int:
        policy = adaptive_split.POLICIES[variant](16)
        policy.update(0, 0, 0.0, 0.010)
        policy.update(2, 0, 0.008, 0.012)  # a failed round: lost 10 ms, so the wait is 0.1 s
        plain = 0
        for i in range(100):
            if policy.choose():
                return plain
            lookup = lookup_rounds and i % 2 == 1  # every other round one of prompt lookup's
            plain += not lookup
            policy.update(2 if lookup else 0, 0, 0.0, 0.012 if lookup else 0.010, lookup=lookup)
        raise AssertionError("no probe")

    alone = plain_steps_before_probe("probe-budget", lookup_rounds=False)
    assert 10 <= alone <= 11  # 0.1 s of 10 ms steps
    assert plain_steps_before_probe("plain-budget", lookup_rounds=False) == alone
    assert plain_steps_before_probe("plain-budget", lookup_rounds=True) == alone
    assert plain_steps_before_probe("probe-budget", lookup_rounds=True) < alone  # lookup's rounds counted


def test_ngram_apart_trial_learns_each_ngram_sizes_acceptance_apart(monkeypatch):
    """benchmarks/adaptive_split.py's `ngram-apart` trial: its lookup says whether a 3-gram or a
    2-gram found the continuation, and its policy's acceptance for lookup is that size's own."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    adaptive_split = importlib.import_module("adaptive_split")
    lookup = adaptive_split.SizedLookup(3, 2)
    assert lookup.lookup([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9] and lookup.matched == 3
    assert lookup.lookup([5, 6, 7, 8, 6, 7], 2) == [8, 6] and lookup.matched == 2
    assert lookup.lookup([5, 6, 7], 2) == [] and lookup.matched == 0
    policy = adaptive_split.ngram_apart_policy(16)
    adaptive_split.SizedLookup.matched = 3
    policy.update(4, 4, 0.0, 0.012, lookup=True)
    adaptive_split.SizedLookup.matched = 2
    for _ in range(3):
        policy.update(4, 0, 0.0, 0.012, lookup=True)
    trusted = policy.lookup_alpha
    adaptive_split.SizedLookup.matched = 3
    assert policy.lookup_alpha > 0.8 > 0.4 > trusted


def test_cost_aware_policy_prior_weighs_more_against_a_fall_than_a_rise():
    """After a round whose drafts were all rejected α is the four-round prior's 0.48, not the
    two-round prior's 0.4 (one failed probe does not end speculation where rounds are cheap);
    after rounds whose drafts were all kept it is the two-round prior's, which rises faster."""
    from verispec.spec.gamma import CostAwareGamma

    policy, both_ways, heavy = CostAwareGamma(), CostAwareGamma(fall_weight=2.0), CostAwareGamma(prior_weight=4.0)
    for p in (policy, both_ways, heavy):
        p.update(2, 0, 0.01, 0.03)
    assert policy.alpha == pytest.approx(0.48) and both_ways.alpha == pytest.approx(0.4)
    for p in (policy, both_ways, heavy):
        for _ in range(5):
            p.update(4, 4, 0.02, 0.04)
    assert policy.alpha == pytest.approx(both_ways.alpha) and policy.alpha > 0.9
    assert heavy.alpha < policy.alpha - 0.02  # a prior worth four both ways holds a good draft back


def test_cost_aware_policy_prices_a_draft_step_not_a_draft_token():
    """A round whose first draft came from the pass that read the context took one draft step
    fewer than its drafts: the policy's cost of a draft step is its time over the steps taken,
    and a round that took none leaves the estimate as it was."""
    from verispec.spec.gamma import CostAwareGamma

    policy = CostAwareGamma()
    policy.update(2, 0, 0.008, 0.013, draft_steps=1)  # two drafts, one step of 8 ms
    assert policy.draft_step_s == 0.008
    policy.update(1, 1, 0.0001, 0.011, draft_steps=0)  # one draft, no step: says nothing of its cost
    assert policy.draft_step_s == 0.008
    policy.update(2, 2, 0.016, 0.013)  # one step per draft unless told
    assert policy.draft_step_s == pytest.approx(0.008)


def test_cost_aware_policy_sends_prompt_lookups_drafts_where_they_promise_more():
    """Prompt lookup's drafts cost only the verification's extra positions: the policy sends
    them in a plain step's place, or the draft model's, where their own acceptance makes the
    rate higher, and learns that acceptance apart from the draft model's."""
    from verispec.spec.gamma import CostAwareGamma

    policy = CostAwareGamma()
    assert policy.lookup_gamma(4, 0) == 0  # the draft model's costs come first
    policy.update(0, 0, 0.0, 0.050)  # a plain step: 50 ms
    policy.verify_s.update({m: 0.050 + 0.004 * m for m in range(2, 18)})
    policy.update(2, 0, 0.020, 0.058)  # the draft model: 10 ms a step, both drafts rejected
    alpha = policy.alpha
    for _ in range(5):  # lookup's drafts mostly kept
        policy.update(4, 4, 0.0, 0.070, lookup=True)
    assert policy.alpha == alpha and policy.draft_step_s == pytest.approx(0.010)  # the model's estimates stand
    assert policy.lookup_alpha > 0.8
    assert policy.lookup_gamma(6, 0) >= 4  # most of them, over a plain step
    assert policy.lookup_gamma(6, 3) >= 4  # and over the draft model's three
    assert policy.lookup_gamma(2, 0) == 2
    for _ in range(20):  # then lookup fails every time
        policy.update(3, 0, 0.0, 0.062, lookup=True)
    assert policy.lookup_alpha < 0.3
    policy.verify_s.update({m: 0.050 + 0.010 * m for m in range(2, 18)})  # and its positions cost more
    assert policy.lookup_gamma(6, 0) == 0  # a plain step promises more
    for _ in range(10):  # the draft model does well
        policy.update(4, 4, 0.040, 0.066)
    assert policy.lookup_gamma(6, 4) == 0


def test_adaptive_sends_prompt_lookups_drafts_and_the_output_stays_the_targets(target, clock):
    """A text that repeats itself gives prompt lookup continuations: with --adaptive and a
    draft model, some rounds send them in the draft model's place, counted apart; greedy
    output is the target's own either way, and `lookup=False` keeps to the draft model.
    The policy weighs measured costs, so they come from the modelled clock, not from how
    busy the machine is."""
    prompt = PROMPT * 4
    plain = generate(target, prompt, max_tokens=60, ignore_eos=True)
    mixed = generate(target, prompt, draft=target, gamma=4, adaptive="cost", max_tokens=60, ignore_eos=True)
    assert mixed.token_ids == plain.token_ids
    assert_accounting(mixed)
    assert 0 < mixed.spec.lookup_drafted <= mixed.spec.drafted
    assert 0 <= mixed.spec.lookup_accepted <= min(mixed.spec.accepted, mixed.spec.lookup_drafted)
    alone = generate(target, prompt, draft=target, gamma=4, adaptive="cost", max_tokens=60, ignore_eos=True,
                     lookup=False)
    assert alone.token_ids == plain.token_ids and alone.spec.lookup_drafted == 0
    fixed = generate(target, prompt, draft=target, gamma=4, max_tokens=60, ignore_eos=True)
    assert fixed.spec.lookup_drafted == 0  # a fixed γ is the draft model's alone


def test_adaptive_draft_stops_reading_when_speculation_does_not_pay(target, unrelated):
    """With drafts that are always wrong, --adaptive decodes plainly and the draft reads only
    the recent context before its rare probes, not every token (prompt lookup, which the
    tiny model's loops would feed, left out)."""
    from verispec.spec.draft_model import DraftModelProposer

    proposer = DraftModelProposer(unrelated, vocab_limit=target.config.vocab_size)
    read = []
    forward = unrelated.model.forward
    unrelated.model.forward = lambda ids, *a, **k: (read.append(ids.shape[1]), forward(ids, *a, **k))[1]
    try:
        result = generate(target, PROMPT, draft=proposer, gamma=4, adaptive="cost", max_tokens=200,
                          ignore_eos=True, lookup=False)
    finally:
        unrelated.model.forward = forward
    assert result.token_ids == generate(target, PROMPT, max_tokens=200, ignore_eos=True).token_ids
    plain = result.spec.gammas.count(0)
    assert plain >= 0.9 * len(result.spec.gammas)
    assert_accounting(result)
    assert result.spec.plain == plain and result.spec.bonus == 0  # drafts always wrong: nothing fully kept
    context = result.prompt_tokens + len(result.token_ids)
    assert sum(read) < 0.6 * context  # a draft kept ready would read all of it


def test_adaptive_reports_the_drafts_reading_of_skipped_context_apart(target, unrelated):
    """With --adaptive a draft model reads the context it skipped just before it drafts: that
    reading counts in the drafting time and is reported on its own too (catch_up_s). A draft
    that read the prompt up front, without --adaptive, has nothing to catch up."""
    from verispec.server.responses import decoding_summary
    from verispec.spec.draft_model import DraftModelProposer

    def draft():
        return DraftModelProposer(unrelated, vocab_limit=target.config.vocab_size)

    lazy = generate(target, PROMPT, draft=draft(), gamma=4, adaptive="cost", max_tokens=40, ignore_eos=True)
    assert 0 < lazy.spec.catch_up_s <= lazy.spec.draft_s
    assert lazy.to_dict()["spec"]["catch_up_s"] == lazy.spec.catch_up_s
    assert decoding_summary(lazy, "draft")["catch_up_s"] == round(lazy.spec.catch_up_s, 4)
    eager = generate(target, PROMPT, draft=draft(), gamma=4, max_tokens=40, ignore_eos=True)
    assert eager.spec.catch_up_s == 0 and eager.spec.draft_s > 0


def test_the_first_draft_after_catching_up_comes_from_the_catch_up_pass(target):
    """catch_up reads the whole unread context in one pass and keeps its last position's
    logits: the first draft costs no pass of its own, and the drafts are those of a draft
    that read the last token in a pass of its own (the panels' rows do not depend on the
    pass's size). Where nothing is left for it, propose reads the last token again."""
    from verispec.sampling import SamplingParams
    from verispec.spec.draft_model import DraftModelProposer

    context = target.tokenizer.encode(PROMPT)
    calls = []

    class Counting:
        def __init__(self, model):
            self.model = model

        def __call__(self, ids, cache, **options):
            calls.append(ids.shape[1])
            return self.model(ids, cache, **options)

        def __getattr__(self, name):
            return getattr(self.model, name)

    merged = DraftModelProposer(target)
    merged.model = Counting(merged.model)
    merged.start(context, len(context) + 8, prefill=False)
    merged.catch_up(context, window=6)
    assert calls == [6] and merged.lag(context) == 0 and merged.offset == len(context) - 6
    proposal = merged.propose(context, 3, SamplingParams(), None)
    drafts = proposal.tokens
    assert calls == [6, 1, 1] and proposal.steps == 2  # drafts 2 and 3; the first came from the catch-up pass

    apart = DraftModelProposer(target)
    apart.start(context, len(context) + 8, prefill=False)
    apart.offset = len(context) - 6
    apart.model(torch.tensor([context[-6:-1]]), apart.cache, last_only=True)
    assert apart.propose(context, 3, SamplingParams(), None).tokens == drafts

    merged.commit(len(context))  # all three drafts rejected: the cache holds the context again
    assert merged.lag(context) == 0 and merged.ready is None
    calls.clear()
    again = merged.propose(context, 3, SamplingParams(), None)
    assert again.tokens == drafts and again.steps is None
    assert calls == [1, 1, 1]  # the last token read again


def _scan_lookup(context: list[int], gamma: int, max_ngram: int, min_ngram: int, bounded: bool = False) -> list[int]:
    """Prompt lookup by scanning the context back, as the definition reads; `bounded`: no more
    tokens than the occurrence and the context's end have in common going back."""
    size = len(context)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = context[size - n:]
        for start in range(size - n - 1, -1, -1):
            if context[start:start + n] == suffix and context[start + n:start + n + gamma]:
                common = max(k for k in range(start + n + 1) if context[start + n - k:start + n] == context[size - k:])
                return context[start + n:start + n + (min(gamma, common) if bounded else gamma)]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram,bounded", [(3, 1, False), (4, 2, False), (1, 1, False), (3, 1, True),
                                                         (2, 2, True)])
def test_prompt_lookups_index_gives_what_scanning_the_context_gives(max_ngram, min_ngram, bounded):
    import random

    rng = random.Random(max_ngram * 10 + min_ngram)
    lookup = PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram, bounded_by_match=bounded)
    for _ in range(20):  # requests of their own, each a text that grows round by round
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        lookup.start(context, 1000)
        for _ in range(rng.randrange(1, 15)):
            gamma = rng.randrange(1, 6)
            assert lookup.lookup(context, gamma) == _scan_lookup(context, gamma, max_ngram, min_ngram, bounded), context
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_prompt_lookup_bounded_by_its_match_drafts_as_far_as_the_match_runs_back():
    lookup = PromptLookupProposer(3, 1, bounded_by_match=True)
    assert lookup.lookup([5, 7, 8, 9, 1, 2, 5], 8) == [7]  # one token matched: one drafted
    assert lookup.lookup([5, 7, 8, 9, 1, 2, 5, 7], 8) == [8, 9]  # [5, 7]: two
    copy = [5, 7, 8, 9, 1, 2, 3, 4, 6, 0, 5, 7, 8, 9, 1, 2]
    assert lookup.lookup(copy, 3) == [3, 4, 6]  # six tokens matched: all of γ = 3
    assert lookup.lookup(copy, 8) == [3, 4, 6, 0, 5, 7]  # of 8, six
    assert PromptLookupProposer(3, 1, bounded_by_match=False).lookup([5, 7, 8, 9, 1, 2, 5], 8) == [7, 8, 9, 1, 2, 5]


def test_prompt_lookup_forgets_a_text_that_another_does_not_continue():
    lookup = PromptLookupProposer(bounded_by_match=False)
    assert lookup.lookup([1, 2, 3, 1, 2], 2) == [3, 1]
    assert lookup.lookup([5, 6, 5], 2) == [6, 5] == _scan_lookup([5, 6, 5], 2, 3, 1)  # shorter: another text
    assert lookup.lookup([9, 6, 5, 9], 2) == [6, 5]  # its first token differs: another text


def test_sample_draws_each_id_by_its_weight_across_blocks_and_never_a_zero():
    """sample() searches blocks of 1,024 ids, then one block: over 3,000 ids whose weight lies at
    block edges, in one heavy id and nowhere else, the draws follow the weights (unnormalised,
    as a residual is), and ids of weight zero never come up."""
    from scipy.stats import chisquare

    from verispec.sampling import sample
    weights = torch.zeros(3000)
    support = [0, 1, 1022, 1023, 1024, 1025, 2047, 2048, 2999]
    weights[support] = torch.tensor([1.0, 2.0, 3.0, 1.0, 4.0, 0.5, 2.5, 1.0, 5.0]) * 0.37
    gen = torch.Generator().manual_seed(7)
    draws = [sample(weights, gen) for _ in range(20_000)]
    assert set(draws) <= set(support)
    expected = weights[support] / weights.sum() * len(draws)
    assert chisquare([draws.count(i) for i in support], expected.tolist()).pvalue > 0.01
    assert sample(torch.tensor([0.0, 0.0, 1.0]), gen) == 2
    with pytest.raises(VerispecError, match="sum to 0"):
        sample(torch.zeros(5), gen)


def test_draft_probs_read_columns_as_token_ids():
    """A limited draft's columns are ids 0..first-1 and then the context's ids: one probability
    per draft, and the residual over the target's vocabulary (ids past it, or a column the draft
    lacks, count as zero)."""
    from verispec.spec.proposer import DraftProbs
    rows = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    q = DraftProbs(rows, extra_ids=[7, 12])  # columns: ids 0, 1, 7, 12
    assert q.first == 2
    assert [q.of(0, t) for t in (0, 1, 7, 12, 5)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.0])
    p = torch.full((10,), 0.1)  # the target's vocabulary: ids 0..9, so id 12 lies outside it
    residual = q.take_from(1, p.clone())
    expected = torch.full((10,), 0.1)
    expected[0], expected[1], expected[7] = 0.0, 0.0, 0.0  # 0.1 - 0.4, 0.1 - 0.3, 0.1 - 0.2
    assert torch.allclose(residual, expected)
    whole = DraftProbs(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))  # a draft of every id, one more than p's 3
    assert whole.first == 4 and whole.of(0, 3) == 0.125
    assert torch.allclose(whole.take_from(0, torch.tensor([0.25, 0.5, 0.25])), torch.tensor([0.0, 0.25, 0.125]))


def test_verifier_with_draft_probabilities_over_columns_is_lossless():
    """A draft over columns [0, 1, then id 3] (id 2 it cannot propose): the verifier's output
    follows the target's distribution, each draft kept by p/q, the rest drawn from the residual."""
    from scipy.stats import chisquare

    from verispec.sampling import SamplingParams
    from verispec.spec.proposer import DraftProbs
    from verispec.spec.verifier import verify_sampling
    logits = torch.tensor([[1.0, 0.5, -0.3, 0.2], [0.0, 0.1, 0.2, 0.3]])
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([0.2, 0.1, 0.7])
    gen = torch.Generator().manual_seed(0)
    counts = [0] * 4
    for _ in range(20_000):
        column = int(torch.multinomial(q, 1, generator=gen))
        draft = [0, 1, 3][column]
        verdict = verify_sampling(logits, [draft], DraftProbs(q[None], extra_ids=[3]), params, gen)
        counts[draft if verdict.accepted else verdict.token] += 1
    expected = torch.softmax(logits[0].double(), -1) * sum(counts)
    assert chisquare(counts, expected.tolist()).pvalue > 0.01


@pytest.fixture(params=["kernel", "numpy"])
def cpu_warp(request):
    """The CPU warp's softmax in the compiled kernel, or in NumPy (kernels off or not built)."""
    from verispec import kernels
    with contextlib.nullcontext() if request.param == "kernel" else kernels.switched_off():
        yield request.param


@pytest.mark.parametrize("columns", [5000, 5003, 7])
def test_probabilities_at_a_temperature_are_torch_softmax(cpu_warp, columns):
    """Temperature alone on the CPU (the kernel's softmax or NumPy's): the same distribution as
    torch's softmax (to float32 rounding) for rows of any length, rows summing to one, -inf
    logits at zero, each row warped alone; top-k keeps k ids."""
    from verispec.sampling import SamplingParams, probabilities
    logits = 3 * torch.randn(3, columns, generator=torch.Generator().manual_seed(1))
    logits[1, 5] = float("-inf")
    got = probabilities(logits, SamplingParams(temperature=0.7))
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert torch.allclose(got, torch.softmax(logits.double() / 0.7, -1).float(), rtol=1e-5, atol=1e-9)
    assert torch.allclose(got.sum(-1), torch.ones(3)) and got[1, 5] == 0
    assert torch.equal(probabilities(logits[2], SamplingParams(temperature=0.7)), got[2])
    assert torch.isinf(logits[1, 5])  # the caller's logits are left as they were
    top = probabilities(logits, SamplingParams(temperature=0.7, top_k=5))
    assert int((top[0] > 0).sum()) == 5


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (3000, 0.95), (0, 0.999)])
def test_the_cpu_warp_keeps_what_torchs_keeps(cpu_warp, top_k, top_p):
    """probabilities() on the CPU (top-p sorting only the ids that hold its mass) gives
    the distribution of the torch path an accelerator takes, the same ids kept, for logits
    whose nucleus is a few ids or thousands."""
    from verispec.sampling import SamplingParams, _warp_on_one_thread, _warp_with_torch
    gen = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = torch.cat([8 * torch.randn(2, 20_000, generator=gen), 0.5 * torch.randn(2, 20_000, generator=gen)])
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    got, expected = _warp_on_one_thread(logits, params), _warp_with_torch(logits, params)
    assert torch.equal(got > 0, expected > 0)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-8)
    assert torch.allclose(got.sum(-1), torch.ones(4))


def test_the_cpu_warp_breaks_ties_as_a_sort_may(cpu_warp):
    """Equal logits at top-k's or top-p's edge: top-k keeps every tie of the k-th (as torch's
    masking does); top-p keeps as many of the tied ids as the mass before each allows."""
    from verispec.sampling import SamplingParams, _warp_on_one_thread, _warp_with_torch
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -2.0]])
    top_k = _warp_on_one_thread(logits, SamplingParams(temperature=1.0, top_k=2))
    assert top_k[0].tolist()[4:] == [0.0, 0.0] and int((top_k > 0).sum()) == 4
    for top_p in (0.6, 0.8, 0.9, 0.97):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        got, expected = _warp_on_one_thread(logits, params), _warp_with_torch(logits, params)
        assert int((got > 0).sum()) == int((expected > 0).sum())
        assert torch.allclose(got.sort(-1).values, expected.sort(-1).values, atol=1e-7)
