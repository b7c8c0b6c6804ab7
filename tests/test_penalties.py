"""Logit bias and presence, frequency and repetition penalties: the penalised target's output,
speculative or not."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import tiny
from verispec.errors import VerispecError
from verispec.generate import generate
from verispec.penalties import LogitsRules, Penalties, PenaltyState

PROMPT = "the cat sat on the mat. the cat sat on the"
STRONG = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.7)


def by_hand(logit: float, generated: int, in_context: bool, presence: float, frequency: float,
            repetition: float, bias: float = 0.0) -> float:
    """The definitions, one logit at a time: the bias first, as vLLM has it."""
    logit = logit + bias
    if in_context:
        logit = logit / repetition if logit > 0 else logit * repetition
    return logit - frequency * generated - presence * (generated > 0)


def test_rows_follow_the_output_and_the_drafts_before_them():
    bias = {1: 1.5, 3: -0.75, 6: 2.0}
    penalties = Penalties(presence=0.25, frequency=0.5, repetition=2.0, logit_bias=bias)
    state = PenaltyState(penalties, prompt_ids=[1, 2])
    state.add([2, 3, 3])
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    drafts = [3, 5, 5]
    got = state.apply(logits, drafts)
    for row in range(4):
        generated = Counter([2, 3, 3, *drafts[:row]])
        for token in range(8):
            in_context = token in (1, 2) or generated[token] > 0
            expected = by_hand(float(logits[row, token]), generated[token], in_context, 0.25, 0.5, 2.0,
                               bias.get(token, 0.0))
            assert float(got[row, token]) == pytest.approx(expected, abs=1e-6), (row, token)
    assert not torch.equal(got, logits) and torch.equal(logits, raw)  # the raw rows stay


def test_reused_rows_are_the_same_rows_written_where_the_last_reused_call_wrote():
    """apply(reuse=True), as greedy verification calls it: the values of a fresh copy, in one
    scratch block from call to call (grown when a pass has more rows), the raw rows untouched."""
    penalties = Penalties(presence=0.25, frequency=0.5, repetition=2.0, logit_bias={1: 1.5})
    state = PenaltyState(penalties, prompt_ids=[1, 2])
    state.add([2, 3, 3])
    generator = torch.Generator().manual_seed(2)
    first, second, longer = (torch.randn(rows, 8, generator=generator) for rows in (4, 3, 12))
    raw = first.clone()
    reused = state.apply(first, [3, 5, 5], reuse=True)
    assert torch.equal(reused, state.apply(first, [3, 5, 5])) and torch.equal(first, raw)
    again = state.apply(second, [5, 5], reuse=True)
    assert again.data_ptr() == reused.data_ptr() and torch.equal(again, state.apply(second, [5, 5]))
    assert torch.equal(state.apply(longer, [5] * 11, reuse=True), state.apply(longer, [5] * 11))
    assert state.apply(second, [5, 5]).data_ptr() != state.apply(second, [5, 5], reuse=True).data_ptr()


def test_each_row_is_what_a_plain_step_at_its_position_sees():
    """Bit for bit: a verification row and the one-row step after the same tokens round alike."""
    penalties = Penalties(presence=0.3, frequency=0.7, repetition=1.3, logit_bias={7: 0.3, 12: -1.1, 30: 4.0})
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 4
    drafts = [7, 7, 9, 11]
    verifying = PenaltyState(penalties, [3, 7, 40])
    verifying.add([7, 12])
    rows = verifying.apply(logits, drafts)
    for row in range(5):
        stepping = PenaltyState(penalties, [3, 7, 40])
        stepping.add([7, 12, *drafts[:row]])
        assert torch.equal(stepping.apply(logits[row:row + 1], [])[0], rows[row])


def test_rows_over_other_columns_are_penalised_by_their_ids():
    """A draft limited to its first ids and the context's has logits over columns that are not
    the ids: ids 0-3, then ids 9 and 6. The penalties follow the ids through the map."""
    # biased ids: one among the first, one in the context, one with no column
    penalties = Penalties(presence=0.4, frequency=0.3, repetition=1.6, logit_bias={1: 2.0, 6: -1.0, 8: 5.0})
    state = PenaltyState(penalties, prompt_ids=[2, 9])
    state.add([6, 1, 6])
    by_id = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    layout = [0, 1, 2, 3, 9, 6]
    columns = {token: i for i, token in enumerate(layout)}
    got = state.apply(by_id[:, layout], drafts=[9], before=[3], column_of=columns.get)
    expected = state.apply(by_id, drafts=[9], before=[3])[:, layout]
    assert torch.equal(got, expected)
    assert not torch.equal(got, by_id[:, layout])


@pytest.mark.parametrize("bad,message", [
    (dict(presence=2.5), "presence penalty must be a number from -2 to 2"),
    (dict(frequency=float("nan")), "frequency penalty must be a number from -2 to 2"),
    (dict(repetition=0), "repetition penalty must be a number > 0"),
    (dict(repetition=True), "repetition penalty must be a number > 0"),
    (dict(logit_bias={3: -100.5}), "logit bias must be a number from -100 to 100"),
    (dict(logit_bias={-3: 1.0}), "keyed by a token id"),
])
def test_bad_penalties_are_refused(bad, message):
    with pytest.raises(VerispecError, match=message):
        Penalties(**bad)


def greedy_by_hand(target, prompt_ids: list[int], steps: int, presence: float, frequency: float,
                   repetition: float, bias: dict[int, float] | None = None) -> list[int]:
    """Plain greedy decoding with the penalties applied logit by logit, on the plain PyTorch path."""
    from verispec.kernels import switched_off

    out: list[int] = []
    with switched_off(), torch.inference_mode():
        for _ in range(steps):
            ids = prompt_ids + out
            logits = target.model(torch.tensor([ids]), target.model.new_cache(len(ids)))[0, -1].tolist()
            generated = Counter(out)
            scored = [by_hand(x, generated[t], t in prompt_ids or generated[t] > 0, presence, frequency, repetition,
                              (bias or {}).get(t, 0.0)) for t, x in enumerate(logits)]
            out.append(max(range(len(scored)), key=scored.__getitem__))
    return out


def test_plain_decoding_is_the_penalised_targets_argmax(target):
    prompt_ids = target.tokenizer.encode(PROMPT)
    result = generate(target, PROMPT, max_tokens=16, ignore_eos=True, **STRONG)
    assert result.token_ids == greedy_by_hand(target, prompt_ids, 16, 0.8, 0.6, 1.7)
    assert result.token_ids != generate(target, PROMPT, max_tokens=16, ignore_eos=True).token_ids


def test_a_bias_steers_plain_and_speculative_decoding_alike(target, unrelated):
    prompt_ids = target.tokenizer.encode(PROMPT)
    free = generate(target, PROMPT, max_tokens=20, ignore_eos=True).token_ids
    bias = {free[0]: -100.0, free[4]: 1.5, 11: 3.0}
    plain = generate(target, PROMPT, max_tokens=20, ignore_eos=True, logit_bias=bias)
    assert free[0] not in plain.token_ids and plain.token_ids != free
    assert plain.token_ids == greedy_by_hand(target, prompt_ids, 20, 0.0, 0.0, 1.0, bias)
    for draft in (target, unrelated, "ngram"):
        result = generate(target, PROMPT, draft=draft, gamma=4, max_tokens=20, ignore_eos=True, logit_bias=bias)
        assert result.token_ids == plain.token_ids
        assert result.spec.drafted > 0
        if draft is target:  # biased as the target is, the draft proposes what the target picks
            assert result.spec.accepted == result.spec.drafted
    forced = generate(target, PROMPT, draft=unrelated, max_tokens=8, ignore_eos=True, logit_bias={5: 100})
    assert forced.token_ids == [5] * 8


@pytest.mark.parametrize("draft_kind", ["self", "unrelated", "ngram", "adaptive"])
def test_speculative_decoding_keeps_the_penalised_output(target, unrelated, draft_kind):
    draft = {"self": target, "unrelated": unrelated, "ngram": "ngram", "adaptive": unrelated}[draft_kind]
    # a negative presence penalty favours repeats, so that prompt lookup finds some to draft
    penalties = dict(presence_penalty=-1.0, frequency_penalty=0.2) if draft_kind == "ngram" else STRONG
    plain = generate(target, PROMPT, max_tokens=30, ignore_eos=True, logprobs=0, **penalties)
    result = generate(target, PROMPT, draft=draft, gamma=5, adaptive=draft_kind == "adaptive", max_tokens=30,
                      ignore_eos=True, logprobs=0, **penalties)
    assert result.token_ids == plain.token_ids
    assert result.spec.drafted > 0
    if draft_kind == "self":  # the draft is penalised as the target is, so it proposes what the target picks
        assert result.spec.accepted == result.spec.drafted
    # the log-probabilities reported are the target's own, before the penalties
    unpenalised = generate(target, PROMPT, max_tokens=1, ignore_eos=True, logprobs=0)
    assert plain.logprobs[0] == unpenalised.logprobs[0]


def test_a_limited_draft_is_penalised_through_its_columns(target):
    """The target drafting its first 100 ids and the context's, after a prompt of every id above
    100, highest first: it can propose any id, from columns that are not the ids. Penalised
    through that map, it proposes what the whole-vocabulary draft proposes under the same
    penalties, and those differ from its unpenalised proposals."""
    from verispec.sampling import SamplingParams
    from verispec.spec.draft_model import DraftModelProposer

    prompt = list(range(tiny.VOCAB - 1, 99, -1))

    def proposals(vocab_limit: int | None, penalty: PenaltyState | None) -> list[int]:
        proposer = DraftModelProposer(target, vocab_limit=vocab_limit, markdown=False)  # the prompt's ids first
        proposer.rules = LogitsRules(penalty)
        proposer.start(prompt, len(prompt) + 8)
        tokens = proposer.propose(prompt, 6, SamplingParams(), None).tokens
        assert vocab_limit is None or proposer.extra_ids[:2] == [tiny.VOCAB - 1, tiny.VOCAB - 2]
        return tokens

    free = proposals(None, None)
    state = PenaltyState(Penalties(presence=2.0, frequency=2.0, logit_bias={free[1]: -5.0, 150: 1.0}), prompt)
    state.add(free)  # as if the output so far held the unpenalised proposals
    penalised = proposals(None, state)
    assert penalised != free and any(token >= 100 for token in free)
    assert proposals(100, state) == penalised


def test_speculative_sampling_follows_the_penalised_distribution():
    """Lossless with a bias and penalties: an unrelated draft still gives the penalised
    target's distribution over three tokens (6 ids, so every sequence can be counted)."""
    from verispec.sampling import SamplingParams
    target, draft = tiny.tiny_lm(6, seed=10), tiny.tiny_lm(6, seed=11)
    prompt = [1, 2, 3]
    bias = {0: -1.5, 4: 1.0}
    penalties = Penalties(presence=0.5, frequency=0.9, repetition=1.5, logit_bias=bias)
    exact = tiny.exact_distribution(target, prompt, 3, SamplingParams(temperature=0.9), penalties)
    counts = dict.fromkeys(exact, 0)
    samples = 8_000
    for i in range(samples):
        result = generate(target, prompt, draft=draft, gamma=2, max_tokens=3, seed=777 + i, temperature=0.9,
                          presence_penalty=0.5, frequency_penalty=0.9, repetition_penalty=1.5, logit_bias=bias)
        counts[tuple(result.token_ids)] += 1
    p_value, cells = tiny.goodness_of_fit(exact, counts)
    assert cells >= 10 and p_value > 0.01
    unpenalised = tiny.exact_distribution(target, prompt, 3, SamplingParams(temperature=0.9))
    assert max(abs(exact[k] - unpenalised[k]) for k in exact) > 0.05  # the penalties matter here
