"""Structured output (`json_schema`, `regex`, `grammar`): the output keeps to its structure, plainly,
speculatively and sampled; speculation keeps the constrained target's output exact; a draft
limited to its first ids is masked through its columns; clear errors; the command line."""

from __future__ import annotations

import json
import re

import pytest
import torch

import tiny
from verispec.generate import generate
from verispec.structured import Structure, StructureError, StructureState

PROMPT = "def add(a, b):"
PATTERN = "[ab]{3}c(cd|t)?"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
GRAMMAR = 'start: ("yes" | "no") " " value\nvalue: %json {"type": "integer", "minimum": 0, "maximum": 99}'


def test_the_mask_allows_what_keeps_the_text_on_course(target):
    state = StructureState(Structure.regex("ab|cd"), target.tokenizer, target.config.vocab_size)
    vocab = tiny.byte_vocab()
    a, b, ab, c, d = (vocab[t] for t in ("a", "b", "ab", "c", "d"))
    allowed = state.allowed(drafts=[a, c], rows=3)
    assert set(allowed[0].nonzero().flatten().tolist()) == {a, ab, c, vocab["cd"]}
    assert allowed[1].nonzero().flatten().tolist() == [b]  # after "a": only "b"
    assert allowed[2].all()  # after a refused draft ("c" after "a"), no choice is made
    assert state.allowed(before=[a])[0].nonzero().flatten().tolist() == [b]
    state.add([ab])
    assert state.allowed()[0].nonzero().flatten().tolist() == [tiny.EOS_ID]  # "ab" is whole: only the end


def test_a_drafts_columns_are_masked_as_their_ids(target):
    """A draft of the first 100 ids and one context id (a space, above them) in column 100."""
    from verispec.spec.draft_model import ColumnMap

    state = StructureState(Structure.regex(" [0-9]"), target.tokenizer, target.config.vocab_size)
    space, digit = tiny.byte_vocab()["\u0120"], tiny.byte_vocab()["7"]
    assert space > 100 > digit
    columns = ColumnMap(100, [space], {space: 100})
    masked = state.apply(torch.zeros(2, 101), drafts=[space], column_of=columns)
    assert masked[0].isfinite().nonzero().flatten().tolist() == [100]  # only the space, in its column
    assert masked[1, digit].isfinite() and not masked[1, 100].isfinite()


def test_rows_ruled_as_read_are_the_pass_ruled_at_once_and_only_rows_read_are_masked(target, monkeypatch):
    """Sampled verification reads a pass's rows up to its first rejection; ruled as read (the
    penalties, then the mask), each row read is the row apply() gives the whole pass, a
    row after a refused draft included, and a row never read is never masked."""
    from verispec.penalties import LogitsRules, Penalties, PenaltyState

    vocab = tiny.byte_vocab()
    a, b, c, x = vocab["a"], vocab["b"], vocab["c"], vocab["x"]
    structure = StructureState(Structure.regex("[ab]+c"), target.tokenizer, target.config.vocab_size)
    rules = LogitsRules(PenaltyState(Penalties(presence=0.5, repetition=1.3), [a, x]), structure)
    rules.add([a])
    logits = torch.randn(5, target.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    raw = logits.clone()
    drafts = [b, x, a, c]  # x is refused: rows 2 and up make no choice, and allow every id
    whole = rules.apply(logits, drafts)
    masks = []
    real_mask = StructureState._mask

    def counted_mask(self, matcher):
        masks.append(matcher)
        return real_mask(self, matcher)

    monkeypatch.setattr(StructureState, "_mask", counted_mask)
    as_read = rules.as_read(logits, drafts)
    assert torch.equal(as_read[1], whole[1]) and torch.equal(as_read[0], whole[0]) and len(masks) == 2
    assert torch.equal(as_read[3], whole[3]) and len(masks) == 2  # after the refused draft: penalised alone
    assert torch.equal(as_read[0], whole[0]) and len(masks) == 2  # a row is ruled once
    assert not whole[0].isfinite().all() and torch.equal(logits, raw)  # the raw rows stay


@pytest.mark.parametrize("seed", range(6))
def test_a_greedy_choice_masks_only_rows_whose_argmax_is_refused(target, seed):
    """Each row's argmax after the greedy shortcut is the argmax of the fully masked row, for
    the target's columns and a limited draft's, with the top id refused, allowed, or tied with
    an allowed id after it."""
    from verispec.sampling import greedy_tokens
    from verispec.spec.draft_model import ColumnMap

    state = StructureState(Structure.regex("[ab]+c"), target.tokenizer, target.config.vocab_size)
    vocab = tiny.byte_vocab()
    a, b, c, x = vocab["a"], vocab["b"], vocab["c"], vocab["x"]
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, target.config.vocab_size, generator=generator)
    logits[0, x] = 50.0  # refused: the row is masked
    logits[1, a] = 50.0  # allowed: the row is left as it is
    logits[2, [vocab["A"], b]] = 50.0  # a refused id tied with an allowed one after it
    drafts = [a, b, vocab["ab"]]
    full = greedy_tokens(state.apply(logits, drafts))
    assert greedy_tokens(state.apply(logits, drafts, greedy=True)) == full
    assert full[:3] == [greedy_tokens(logits[0:1].masked_fill(~state.allowed()[0], float("-inf")))[0], a, b]
    columns = ColumnMap(100, [c], {c: 100})  # a draft of the first 100 ids and one above them
    narrow = torch.cat([logits[:, :100], logits[:, c:c + 1]], 1)
    assert (greedy_tokens(state.apply(narrow, drafts, column_of=columns, greedy=True))
            == greedy_tokens(state.apply(narrow, drafts, column_of=columns)))


def test_an_id_the_matcher_validates_is_one_its_mask_allows(target):
    """What the greedy shortcut rests on: along a path through a structure, every id that
    validate_tokens accepts is set in the mask (the mask may allow more: at the end, the
    end-of-text id, which the shortcut then masks for)."""
    state = StructureState(Structure.json(SCHEMA), target.tokenizer, target.config.vocab_size)
    path = target.tokenizer.encode('{"ok": true, "n": 12}')
    for row, matcher in state._looking_ahead(path, (), len(path) + 1):
        mask = state._mask(matcher)
        valid = [i for i in range(target.config.vocab_size) if matcher.validate_tokens([i])]
        assert mask[valid].all() and (valid or row == len(path)), row  # none valid once the object is whole


def test_a_greedy_row_whose_argmax_is_allowed_computes_no_mask(target, monkeypatch):
    state = StructureState(Structure.regex("[ab]+c"), target.tokenizer, target.config.vocab_size)
    a = tiny.byte_vocab()["a"]
    logits = torch.zeros(2, target.config.vocab_size)
    logits[:, a] = 1.0
    masks = []
    real_mask = state._mask
    monkeypatch.setattr(state, "_mask", lambda matcher: masks.append(1) or real_mask(matcher))
    assert state.apply(logits, [a], greedy=True) is logits and not masks
    state.apply(logits, [a])
    assert len(masks) == 2


def json_tokenizer():
    """Byte-level BPE with tokens that span JSON's lexemes, as real vocabularies have them:
    '":', ' "', '"' + newline, ' {' + newline."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from verispec.loading.tokenizer import Tokenizer

    merges = [('"', ":"), ("\u0120", '"'), ('"', "\u010a"), ("\u0120", "{"), ("\u0120{", "\u010a"), ("p", "y")]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Backend(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    return Tokenizer(backend, {backend.token_to_id("<|end|>")})


def test_looking_ahead_leaves_the_matcher_as_it_was():
    """Masks computed after drafts that close a string and start a line, then the output taking
    another way: the matcher allows what one that only read the output allows. (Rolling the
    drafts back on the matcher itself left it refusing part of it.)"""
    tokenizer = json_tokenizer()

    def state_after(text: str) -> StructureState:
        state = StructureState(Structure.json(True), tokenizer, tokenizer.vocab_size)
        state.add(tokenizer.encode(text))
        return state

    looked = state_after('{"code')
    looked.allowed(before=tokenizer.encode('": "python"\n'))
    looked.add(tokenizer.encode('": {\n'))
    assert torch.equal(looked.allowed(), state_after('{"code": {\n').allowed())


def test_a_regex_output_matches_whole_and_ends_there(target):
    result = generate(target, PROMPT, regex=PATTERN, max_tokens=20)
    assert re.fullmatch(PATTERN, result.text) and result.finish_reason == "eos"
    assert result.text != generate(target, PROMPT, max_tokens=len(result.token_ids)).text


def test_a_grammar_output_is_derived_from_it(target):
    result = generate(target, PROMPT, grammar=GRAMMAR, max_tokens=20)
    assert re.fullmatch(r"(yes|no) (\d|[1-9]\d)", result.text) and result.finish_reason == "eos"


@pytest.mark.parametrize("structure", [{"regex": PATTERN}, {"json_schema": SCHEMA}, {"grammar": GRAMMAR}])
def test_speculation_keeps_the_constrained_output(target, unrelated, structure):
    plain = generate(target, PROMPT, max_tokens=48, **structure)
    for draft in (target, unrelated, "ngram"):
        spec = generate(target, PROMPT, max_tokens=48, draft=draft, gamma=4, **structure)
        assert spec.token_ids == plain.token_ids
    if "json_schema" in structure and plain.finish_reason == "eos":
        value = json.loads(plain.text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_the_target_as_its_own_draft_keeps_every_draft(target):
    """The draft is masked as the target is, so the target keeps every draft (the structure's
    end lies past the token budget); with the draft's masks switched off, drafts are lost."""
    from verispec.spec.draft_model import DraftModelProposer

    class Unmasked(DraftModelProposer):
        rules = property(lambda self: None, lambda self, value: None)

    masked = generate(target, PROMPT, regex="[cd]{40}", max_tokens=12, draft=target, gamma=3)
    assert masked.spec.acceptance_rate == 1.0
    unmasked = generate(target, PROMPT, regex="[cd]{40}", max_tokens=12, draft=Unmasked(target), gamma=3)
    assert unmasked.token_ids == masked.token_ids and unmasked.spec.acceptance_rate < 1.0


def test_a_draft_limited_to_its_first_ids_is_masked_through_its_columns(target):
    """Digits are single bytes, ids below 100: a draft of the first 100 ids and the context's,
    masked through its columns, proposes what the target picks."""
    plain = generate(target, PROMPT, regex="[0-9]{40}", max_tokens=12)
    spec = generate(target, PROMPT, regex="[0-9]{40}", max_tokens=12, draft=target, gamma=3, draft_vocab=100)
    assert spec.token_ids == plain.token_ids and spec.spec.draft_vocab == 100
    assert spec.spec.acceptance_rate == 1.0


def test_sampled_output_keeps_its_structure(target, unrelated):
    for seed in range(6):
        for draft in (None, unrelated):
            result = generate(target, PROMPT, regex=PATTERN, max_tokens=20, temperature=1.0, seed=seed,
                              draft=draft, gamma=3)
            assert re.fullmatch(PATTERN, result.text) and result.finish_reason == "eos"


@pytest.mark.parametrize("options,message", [
    ({"regex": "[ab"}, "could not be compiled"),
    ({"json_schema": {"type": "nonsense"}}, "could not be compiled"),
    ({"json_schema": [1, 2]}, "is a JSON object"),
    ({"regex": "a", "json_schema": SCHEMA}, "not a JSON schema and a regular expression"),
    ({"grammar": 'start: "a"', "json_schema": True}, "not a JSON schema and a grammar"),
    ({"grammar": "start: (", "json_schema": None}, "the grammar could not be compiled"),
    ({"grammar": " "}, "a grammar is a non-empty string"),
    ({"regex": "a+", "ignore_eos": True}, "leave out ignore_eos"),
    ({"regex": "a+", "min_tokens": 2}, "leave out ignore_eos and min_tokens"),
])
def test_bad_structures_are_clear_errors(target, options, message):
    with pytest.raises(StructureError, match=message):
        generate(target, PROMPT, max_tokens=4, **options)


def test_the_command_line_holds_the_output_to_a_structure(target, tmp_path, capsys):
    from verispec.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    args = ["generate", "--model", str(target.path), "-n", "24", "--json", PROMPT]
    assert main([*args[:-1], "--regex", PATTERN, PROMPT]) == 0
    assert re.fullmatch(PATTERN, json.loads(capsys.readouterr().out)["text"])
    assert main([*args[:-1], "--json-schema", str(schema_file), PROMPT]) == 0
    from_file = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args[:-1], "--json-schema", json.dumps(SCHEMA), PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == from_file
    assert from_file == generate(target, PROMPT, max_tokens=24, json_schema=SCHEMA).token_ids
    with pytest.raises(SystemExit):
        main([*args[:-1], "--json-schema", "{not json", PROMPT])
    assert "expected a JSON schema" in capsys.readouterr().err
    assert main([*args[:-1], "--regex", "[ab", PROMPT]) == 1
    assert "could not be compiled" in capsys.readouterr().err
    grammar_file = tmp_path / "answer.lark"
    grammar_file.write_text(GRAMMAR)
    for grammar in (GRAMMAR, str(grammar_file)):
        assert main([*args[:-1], "--grammar", grammar, PROMPT]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == generate(target, PROMPT, max_tokens=24,
                                                                       grammar=GRAMMAR).text
