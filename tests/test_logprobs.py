"""Log-probabilities: the target's own, the same whether a token came from a plain step or a verification."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import tiny
from verispec.errors import VerispecError
from verispec.events import Finished, Prompt, Token
from verispec import generate as generate_module
from verispec.generate import generate, stream
from verispec.loading.tokenizer import Tokenizer

PROMPT = "the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def baseline(target):
    return generate(target, PROMPT, max_tokens=30, ignore_eos=True, logprobs=3)


def whole_text_log_softmax(target, ids: list[int]) -> torch.Tensor:
    """log-softmax of the target's logits over prompt + output in one pass, on the plain PyTorch path."""
    from verispec.kernels import switched_off

    with switched_off(), torch.inference_mode():
        logits = target.model(torch.tensor([ids]), target.model.new_cache(len(ids)))[0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_are_the_targets_log_softmax(target, baseline):
    prompt_ids = target.tokenizer.encode(PROMPT)
    reference = whole_text_log_softmax(target, prompt_ids + baseline.token_ids)
    assert len(baseline.logprobs) == len(baseline.token_ids) == 30
    for i, (token, lp) in enumerate(zip(baseline.token_ids, baseline.logprobs)):
        row = reference[len(prompt_ids) - 1 + i]  # the position that predicts token i
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-4)
        expected = torch.topk(row, 3)
        assert [i for i, _ in lp.top] == expected.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(expected.values.tolist(), abs=1e-4)
        assert lp.top[0] == (token, lp.logprob)  # greedy: the token is the likeliest


@pytest.mark.parametrize("draft_kind", ["self", "unrelated", "ngram", "adaptive"])
def test_speculative_logprobs_are_plain_decodings(target, unrelated, baseline, draft_kind):
    draft = {"self": target, "unrelated": unrelated, "ngram": "ngram", "adaptive": unrelated}[draft_kind]
    result = generate(target, PROMPT, draft=draft, gamma=5, adaptive=draft_kind == "adaptive", max_tokens=30,
                      ignore_eos=True, logprobs=3)
    assert result.token_ids == baseline.token_ids
    assert result.spec.drafted > 0
    for got, want in zip(result.logprobs, baseline.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [i for i, _ in got.top] == [i for i, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)


def test_sampled_tokens_carry_their_logprobs_in_the_stream(target, unrelated):
    events = list(stream(target, PROMPT, draft=unrelated, gamma=4, max_tokens=25, temperature=0.9, seed=7,
                         ignore_eos=True, logprobs=5))
    tokens = [e for e in events if isinstance(e, Token)]
    result = events[-1].result
    assert isinstance(events[-1], Finished)
    assert [t.logprob for t in tokens] == result.logprobs
    for lp in result.logprobs:
        values = [v for _, v in lp.top]
        assert len(lp.top) == 5 and values == sorted(values, reverse=True)
        assert lp.logprob <= values[0] <= 0.0 and math.isfinite(lp.logprob)
    assert result.to_dict()["logprobs"][0] == {"logprob": result.logprobs[0].logprob,
                                               "top": [list(pair) for pair in result.logprobs[0].top]}


def test_without_logprobs_nothing_is_computed(target):
    result = generate(target, PROMPT, max_tokens=3, ignore_eos=True)
    assert result.logprobs is None and "logprobs" not in result.to_dict()
    assert generate(target, PROMPT, max_tokens=3, ignore_eos=True, logprobs=0).logprobs[0].top == ()


@pytest.mark.parametrize("logprobs", [-1, 21, 1.5, "3"])
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_bad_logprobs_are_refused(target, logprobs, name):
    with pytest.raises(VerispecError, match=f"{name} must be a whole number from 0 to 20"):
        generate(target, PROMPT, max_tokens=2, **{name: logprobs})


@pytest.fixture
def small_prompt_chunks(monkeypatch):
    """Prompt log-probabilities read 4 positions a pass, so a short prompt takes several."""
    monkeypatch.setattr(generate_module, "PROMPT_CHUNK", 4)


def test_prompt_logprobs_are_the_targets_log_softmax(target, small_prompt_chunks):
    events = list(stream(target, PROMPT, max_tokens=5, ignore_eos=True, prompt_logprobs=3))
    prompt_ids = target.tokenizer.encode(PROMPT)
    assert len(prompt_ids) > 3 * 4
    assert isinstance(events[0], Prompt) and events[0].token_ids == prompt_ids
    scored = events[0].logprobs
    assert len(scored) == len(prompt_ids) and scored[0] is None  # nothing comes before the first token
    reference = whole_text_log_softmax(target, prompt_ids)
    for i in range(1, len(prompt_ids)):
        row = reference[i - 1]
        assert scored[i].logprob == pytest.approx(float(row[prompt_ids[i]]), abs=1e-4)
        assert [j for j, _ in scored[i].top] == torch.topk(row, 3).indices.tolist()
    result = events[-1].result
    assert result.prompt_logprobs == scored
    assert result.to_dict()["prompt_logprobs"][:2] == [None, scored[1].to_dict()]


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", "plain PyTorch"])
def test_scoring_the_prompt_leaves_the_answer_alone(tmp_path, small_prompt_chunks, fmt):
    """Read in chunks, the prompt gives the cache and the first logits the one-pass prefill gives."""
    from verispec.kernels import switched_off

    tiny.save_hf_model(tmp_path, "qwen2", seed=1)
    model = tiny.load_as(tmp_path, "float32" if fmt == "plain PyTorch" else fmt)
    with switched_off() if fmt == "plain PyTorch" else contextlib.nullcontext():
        plain = generate(model, PROMPT, max_tokens=20, ignore_eos=True, logprobs=2)
        scored = generate(model, PROMPT, max_tokens=20, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    assert scored.token_ids == plain.token_ids
    if fmt != "plain PyTorch":  # the kernels' rows do not depend on how many a pass holds
        assert scored.logprobs == plain.logprobs
    assert len(scored.prompt_logprobs) == scored.prompt_tokens


def test_no_tokens_asked_for_scores_the_prompt_alone(target, unrelated):
    events = list(stream(target, PROMPT, draft=unrelated, max_tokens=0, prompt_logprobs=0))
    assert [type(e) for e in events] == [Prompt, Finished]
    result = events[-1].result
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    assert result.spec.plain == 0 and result.spec.drafted == 0
    assert all(lp.top == () for lp in events[0].logprobs[1:])


def test_a_byte_level_tokens_bytes_join_into_the_texts_bytes():
    tokenizer = Tokenizer(tiny.tiny_tokenizer(), {tiny.EOS_ID})
    text = "naïve 数据 😀 the cat\n\tsat"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(len(p.decode("utf-8", errors="replace")) != len(p.decode("utf-8", errors="ignore")) for p in pieces)
    assert tokenizer.token_bytes(tiny.EOS_ID) == b"<|im_end|>"


def test_sentencepiece_tokens_give_their_bytes_and_spaces():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581the": 1, "<0xE6>": 2, "<0x95>": 3, "<0xB0>": 4, "cat": 5}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = Tokenizer(backend, set())
    assert [tokenizer.token_bytes(i) for i in (1, 2, 3, 4, 5)] == [b" the", b"\xe6", b"\x95", b"\xb0", b"cat"]
    assert b"".join(tokenizer.token_bytes(i) for i in (1, 2, 3, 4)).decode() == " the\u6570"
