"""TextAssembler: the text it hands out token by token is the text of the whole output."""

from __future__ import annotations

import random

import pytest

from tiny import tiny_tokenizer
from verispec.generate import TextAssembler


class Backend:
    """The decode call TextAssembler uses, on a `tokenizers` tokenizer, counting the ids it decodes."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def metaspace_tokenizer():
    """Word pieces whose decoder turns '▁' into a space and drops the text's leading one."""
    from tokenizers import Tokenizer, decoders, models

    words = ["▁the", "▁cat", "▁sat", "s", "at", "▁on", "▁mat", ".", "▁", "<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    return tok


def wordpiece_tokenizer():
    """A WordPiece decoder: a space before every token but the first, none before '##' pieces."""
    from tokenizers import Tokenizer, decoders, models

    words = ["the", "cat", "##s", "sat", "on", "mat", "##ted", ".", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    return tok


def assemble(tokenizer, ids, stop=()):
    text = TextAssembler(tokenizer, stop)
    pieces, stopped = [], False
    for token_id in ids:
        piece, stopped = text.add(token_id)
        pieces.append(piece)
        if stopped:
            break
    pieces.append(text.flush())
    return "".join(pieces), stopped, text.text


@pytest.mark.parametrize("make", [tiny_tokenizer, metaspace_tokenizer, wordpiece_tokenizer])
def test_pieces_join_to_the_whole_outputs_text(make):
    tok = make()
    vocab = tok.get_vocab_size()
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        joined, stopped, text = assemble(tok, ids)
        assert not stopped
        assert joined == text == tok.decode(ids, skip_special_tokens=True), ids


def test_a_character_split_over_tokens_is_printed_once_whole():
    tok = tiny_tokenizer()
    ids = tok.encode("naïve café 😀 ok").ids
    text = TextAssembler(tok, ())
    pieces = [text.add(i)[0] for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + text.flush() == "naïve café 😀 ok"


def reference_stop(tok, ids, stop):
    """The text up to the first listed stop string found in the whole output, and whether one was."""
    for end in range(1, len(ids) + 1):
        full = tok.decode(ids[:end], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            continue
        for s in stop:
            if s in full:
                return full[:full.find(s)], True
    return tok.decode(ids, skip_special_tokens=True), False


def test_stop_strings_across_token_borders_match_the_whole_texts():
    tok = tiny_tokenizer()
    rng = random.Random(1)
    alphabet = "ab c\n"
    for _ in range(200):
        sample = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        ids = tok.encode(sample).ids
        stop = [rng.choice(["ab", "b c", "\n\n", "cab", "zz"]) for _ in range(rng.randrange(1, 3))]
        joined, stopped, text = assemble(tok, ids, stop)
        expected, expected_stop = reference_stop(tok, ids, stop)
        assert (joined, stopped, text) == (expected, expected_stop, expected), (sample, stop)


def test_a_stop_string_is_never_handed_out():
    tok = tiny_tokenizer()
    text = TextAssembler(tok, ["STOP"])
    handed = ""
    for token_id in tok.encode("one two ST STO STOP three").ids:
        piece, stopped = text.add(token_id)
        handed += piece
        if stopped:
            break
    assert stopped and handed == "one two ST STO " and text.text == handed


def test_each_token_decodes_a_window_not_the_whole_output():
    backend = Backend(tiny_tokenizer())
    ids = backend.tok.encode("word " * 400).ids
    text = TextAssembler(backend, ())
    for token_id in ids:
        text.add(token_id)
    assert text.text == "word " * 400
    assert backend.decoded <= 4 * len(ids)  # the whole output each time: ~len(ids)² / 2
