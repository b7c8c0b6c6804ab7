"""Filling in the middle (`suffix`): the prompt a code model reads, the tokens that end a
middle, speculative decoding's exactness there, clear errors, and the command line."""

from __future__ import annotations

import json

import pytest

import tiny
from verispec.errors import VerispecError
from verispec.generate import generate
from verispec.loading import load_model
from verispec.loading.tokenizer import InfillError

PREFIX, SUFFIX = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_PAD = range(tiny.VOCAB, tiny.VOCAB + len(tiny.INFILL_SPECIALS))
END_OF_TEXT = tiny.byte_vocab()["<|endoftext|>"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen2-shaped model whose tokenizer holds Qwen2.5-Coder's fill-in-the-middle marks."""
    path = tmp_path_factory.mktemp("coder")
    tiny.save_hf_model(path, "qwen2", seed=4, vocab_size=tiny.VOCAB + len(tiny.INFILL_SPECIALS))
    tiny.write_tokenizer(path, infill=True)
    return path


@pytest.fixture(scope="module")
def coder(folder):
    return load_model(folder)


def test_the_prompt_frames_the_gap(coder):
    tokenizer = coder.tokenizer
    ids = tokenizer.encode_infill(PREFIX, SUFFIX)
    assert ids == [FIM_PREFIX, *tokenizer.encode(PREFIX), FIM_SUFFIX, *tokenizer.encode(SUFFIX), FIM_MIDDLE]
    assert tokenizer.infill_end_ids == {tiny.EOS_ID, END_OF_TEXT, FIM_PAD}
    result = generate(coder, PREFIX, suffix=SUFFIX, max_tokens=8, ignore_eos=True)
    assert result.prompt_tokens == len(ids)
    assert result.token_ids == generate(coder, ids, max_tokens=8, ignore_eos=True).token_ids


@pytest.mark.parametrize("end", [FIM_PAD, END_OF_TEXT])
def test_a_middle_ends_at_padding_or_the_end_of_text(coder, end):
    """Pushed up by +100 after min_tokens holds it off for 3 tokens, a token that ends a
    middle ends the text there, plainly and speculatively; after the same ids sent as a
    prompt of ids, with no suffix, it is just another token."""
    forced = dict(max_tokens=12, min_tokens=3, logit_bias={end: 100.0})
    ids = coder.tokenizer.encode_infill(PREFIX, SUFFIX)
    plain = generate(coder, PREFIX, suffix=SUFFIX, **forced)
    assert len(plain.token_ids) == 3 and plain.finish_reason == "eos"
    for draft in (coder, "ngram"):
        assert generate(coder, PREFIX, suffix=SUFFIX, draft=draft, gamma=3, **forced).token_ids == plain.token_ids
    assert end in generate(coder, ids, **forced).token_ids


def test_speculative_infill_equals_plain(coder):
    plain = generate(coder, PREFIX, suffix=SUFFIX, max_tokens=16, ignore_eos=True)
    itself = generate(coder, PREFIX, suffix=SUFFIX, max_tokens=16, ignore_eos=True, draft=coder, gamma=3)
    lookup = generate(coder, PREFIX, suffix=SUFFIX, max_tokens=16, ignore_eos=True, draft="ngram", gamma=3)
    assert itself.token_ids == lookup.token_ids == plain.token_ids
    assert itself.spec.acceptance_rate == 1.0  # the target as its own draft reads the same prompt


def test_a_model_without_marks_refuses_a_suffix(target):
    with pytest.raises(InfillError, match="no fill-in-the-middle tokens"):
        generate(target, PREFIX, suffix=SUFFIX, max_tokens=4)


@pytest.mark.parametrize("prompt,options", [
    (PREFIX, {"chat": True}),
    ([5, 6, 7], {}),
    ([{"role": "user", "content": PREFIX}], {}),
])
def test_a_suffix_needs_a_plain_text_prompt(coder, prompt, options):
    with pytest.raises(VerispecError, match="plain text prompt"):
        generate(coder, prompt, suffix=SUFFIX, max_tokens=4, **options)


def test_the_command_line_fills_in_the_middle(folder, tmp_path, capsys):
    from verispec.cli import main

    args = ["generate", "--model", str(folder), "-n", "10", "--ignore-eos", "--json", "--suffix", SUFFIX, PREFIX]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["token_ids"] == generate(load_model(folder), PREFIX, suffix=SUFFIX, max_tokens=10,
                                            ignore_eos=True).token_ids
    assert main([*args[:-1], "--chat", PREFIX]) == 1
    assert "without chat" in capsys.readouterr().err

    plain = tmp_path / "plain"
    tiny.save_hf_model(plain, "qwen2", seed=1)
    assert main(["generate", "--model", str(plain), "-n", "4", "--suffix", SUFFIX, PREFIX]) == 1
    err = capsys.readouterr().err
    assert "cannot take a suffix" in err and "Traceback" not in err
