"""A draft limited to the first token ids: its output layer computes only their logits, and
speculation stays exact."""

from __future__ import annotations

import pytest
import torch

import tiny
from verispec import kernels
from verispec.errors import VerispecError
from verispec.generate import encode_prompt, generate
from verispec.spec.draft_model import DraftModelProposer, markdown_ids
from verispec.quant import FORMATS

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tiny.save_hf_model(path, "qwen2", seed=5)
    return path


_load = tiny.load_as


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "pytorch"])
@pytest.mark.parametrize("outputs", [64, 100, 261])
def test_the_first_outputs_are_the_whole_logits_first_columns(folder, fmt, fast, outputs):
    kernels.set_enabled(fast)
    try:
        model = _load(folder, fmt).model
        assert (model.fast_path is not None and model.fast_path.applies(torch.zeros(1, 1), model.new_cache(1))) == (
            fast and kernels.cpu_kernels() is not None)
        ids = torch.tensor([[5, 77, 100, 3, 9, 200, 42]])
        with torch.inference_mode():
            cache = model.new_cache(16)
            whole = model(ids, cache)
            cache.rollback(0)
            first = model(ids, cache, outputs=outputs)
            cache.rollback(5)
            step_whole = model(ids[:, 5:6], cache, last_only=True)
            cache.rollback(5)
            step = model(ids[:, 5:6], cache, last_only=True, outputs=outputs)
    finally:
        kernels.set_enabled(True)
    assert first.shape == (1, 7, outputs) and step.shape == (1, 1, outputs)
    assert torch.equal(first, whole[..., :outputs])
    assert torch.equal(step, step_whole[..., :outputs])


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    tiny.save_hf_model(path, "qwen2", seed=5, tie_word_embeddings=True)
    return path


def drafted_tokens(result) -> list[tuple[int, list[int]]]:
    """Each kept draft with the output before it."""
    return [(t, result.token_ids[:i]) for i, (t, kind) in enumerate(zip(result.token_ids, result.origins))
            if kind == "draft"]


@pytest.mark.parametrize("fmt", ["int4", "float32"])
def test_speculation_with_a_limited_draft_is_the_targets_output(folder, fmt):
    """A draft limited to the first ids proposes only them (`context_ids=False`), or them and
    the ids of the context, their rows read from the output layer's panels in any format; it
    keeps more of its drafts for the context's."""
    target = _load(folder, fmt)
    plain = generate(target, PROMPT, max_tokens=32, ignore_eos=True)
    limit = sorted(plain.token_ids)[len(plain.token_ids) // 2] + 1  # some of the target's tokens lie above it
    limited = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True, draft_vocab=limit)
    first_only = generate(target, PROMPT, draft=DraftModelProposer(target, vocab_limit=limit, context_ids=False),
                          gamma=4, max_tokens=32, ignore_eos=True)
    whole = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True)
    assert limited.token_ids == first_only.token_ids == plain.token_ids == whole.token_ids
    assert drafted_tokens(first_only) and max(t for t, _ in drafted_tokens(first_only)) < limit
    above = [(t, before) for t, before in drafted_tokens(limited) if t >= limit]
    known = set(encode_prompt(target.tokenizer, PROMPT, False)) | set(markdown_ids(target.tokenizer))
    assert above and all(t in known or t in before for t, before in above)  # the context's ids, or Markdown's
    assert first_only.spec.acceptance_rate < limited.spec.acceptance_rate < whole.spec.acceptance_rate == 1.0


@pytest.mark.parametrize("fmt", ["int4", "float32"])
def test_a_limited_draft_proposes_markdowns_marks_before_the_context_has_them(folder, fmt):
    """Markdown's marks above the limit are the draft's from the start of every request, their
    logits those of the whole output layer; without `markdown` only the context's ids are."""
    target = _load(folder, fmt)
    marks = markdown_ids(target.tokenizer)
    assert set(target.tokenizer.encode("```", add_special_tokens=False)) <= set(marks)
    prompt = encode_prompt(target.tokenizer, PROMPT, False)
    limit = sorted(marks)[len(marks) // 2]
    outside = [t for t in marks if t >= limit and t not in prompt]
    assert outside
    without = DraftModelProposer(target, vocab_limit=limit, markdown=False)
    without.start(prompt, 64)
    assert without.extra_ids == []
    proposer = DraftModelProposer(target, vocab_limit=limit)
    for _ in range(2):  # every request starts with them
        proposer.start(prompt, 64)
        assert proposer.extra_ids == [t for t in marks if t >= limit]
    with torch.inference_mode():
        proposer.cache.rollback(len(prompt) - 1)
        logits = proposer._logits(torch.tensor([prompt[-1:]]))
        whole = target.model(torch.tensor([prompt]), target.model.new_cache(64))[0, -1]
    assert torch.equal(logits[:limit], whole[:limit])
    tolerance = 1e-4 if fmt == "float32" else 0.05 * float(whole.abs().max())
    assert torch.allclose(logits[[proposer.extra_columns[t] for t in outside]], whole[outside], atol=tolerance)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("panels", [True, False], ids=["panels", "canonical"])
def test_an_output_layer_gives_the_rows_of_a_few_ids(fmt, panels):
    """PackedLinear.rows(ids) reads the weight's rows `ids` from whichever layout the layer
    holds: the rows of its whole dense weight."""
    from verispec.quant import pack_linear

    linear = torch.nn.Linear(64, 272, bias=False)  # 17 panels of 16 rows
    head = pack_linear(linear, fmt)
    if panels:
        head._use_panels(kernels.cpu_kernels())
    assert (head.panels is not None) == panels
    ids = torch.tensor([200, 7, 250, 16, 17])
    assert torch.equal(head.rows(ids), head.dense_weight().float()[ids])


@pytest.mark.parametrize("fmt", ["int4", "float32"])
def test_a_tied_draft_proposes_the_contexts_ids_above_its_limit(tied_folder, fmt):
    """Where the output layer is the embedding, the context's rows come from the embedding,
    in any weight format."""
    target = _load(tied_folder, fmt)
    plain = generate(target, PROMPT, max_tokens=32, ignore_eos=True)
    limit = sorted(plain.token_ids)[len(plain.token_ids) // 2] + 1
    limited = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True, draft_vocab=limit)
    assert limited.token_ids == plain.token_ids
    above = [(t, before) for t, before in drafted_tokens(limited) if t >= limit]
    known = set(encode_prompt(target.tokenizer, PROMPT, False)) | set(markdown_ids(target.tokenizer))
    assert above and all(t in known or t in before for t, before in above)


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("fast", [True, False], ids=["kernels", "pytorch"])
def test_extra_rows_append_those_ids_logits(tied_folder, fmt, fast):
    """forward(..., extra_rows=rows) appends the hidden state's products with the rows: for
    the output layer's own rows, the whole logits' columns of those ids (up to the rounding
    of another product, and of the layer's own precision)."""
    kernels.set_enabled(fast)
    try:
        model = _load(tied_folder, fmt).model
        ids, extra = torch.tensor([[5, 77, 100, 3, 9]]), torch.tensor([200, 7, 250])
        with torch.inference_mode():
            cache = model.new_cache(16)
            whole = model(ids, cache)
            cache.rollback(0)
            rows = model.model.embed_tokens(extra).float()
            logits = model(ids, cache, outputs=64, extra_rows=rows)
    finally:
        kernels.set_enabled(True)
    assert logits.shape == (1, 5, 67)
    assert torch.equal(logits[..., :64], whole[..., :64])
    tolerance = 1e-4 if fmt == "float32" else 0.05 * float(whole.abs().max())
    assert torch.allclose(logits[..., 64:], whole[..., extra], atol=tolerance)


def test_sampling_with_a_limited_draft_decodes(folder):
    target = _load(folder, "float32")
    result = generate(target, PROMPT, draft=target, gamma=3, max_tokens=24, ignore_eos=True, temperature=0.8,
                      seed=1, draft_vocab=128)
    assert len(result.token_ids) == 24
    known = set(encode_prompt(target.tokenizer, PROMPT, False)) | set(markdown_ids(target.tokenizer))
    assert all(t < 128 or t in known or t in before for t, before in drafted_tokens(result))


def test_auto_limits_only_a_vocabulary_more_than_twice_its_number():
    from verispec.spec.draft_model import AUTO_DRAFT_VOCAB, draft_vocab_limit

    assert AUTO_DRAFT_VOCAB == 32768
    assert draft_vocab_limit("auto", 151936) == 32768  # Qwen2.5's
    assert draft_vocab_limit("auto", 65536) is None and draft_vocab_limit("auto", 49152) is None
    assert draft_vocab_limit(None, 151936) is None
    assert draft_vocab_limit(1000, 151936) == 1000 and draft_vocab_limit(151936, 151936) is None


def test_a_large_vocabulary_is_limited_by_default_and_none_keeps_it_whole(folder, monkeypatch):
    """generate's default ("auto") limits a draft whose vocabulary is more than twice the
    number (here 64 of 262 ids): above it the draft proposes only the context's ids and
    Markdown's; with draft_vocab=None it proposes any. The output is the target's every way."""
    monkeypatch.setattr("verispec.spec.draft_model.AUTO_DRAFT_VOCAB", 64)
    target = _load(folder, "float32")
    plain = generate(target, PROMPT, max_tokens=32, ignore_eos=True)
    prompt_ids = set(encode_prompt(target.tokenizer, PROMPT, False)) | set(markdown_ids(target.tokenizer))
    by_default = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True)
    whole = generate(target, PROMPT, draft=target, gamma=4, max_tokens=32, ignore_eos=True, draft_vocab=None)
    assert by_default.token_ids == whole.token_ids == plain.token_ids
    assert by_default.spec.draft_vocab == 64 and whole.spec.draft_vocab is None  # what the statistics report
    assert by_default.to_dict()["spec"]["draft_vocab"] == 64
    assert all(t < 64 or t in prompt_ids or t in before for t, before in drafted_tokens(by_default))
    assert any(t >= 64 and t not in prompt_ids and t not in before for t, before in drafted_tokens(whole))


def test_the_draft_vocabulary_is_the_pairs_and_the_lab_records_the_one_decoding_uses(folder, tmp_path, monkeypatch):
    """A draft with more rows than its target's vocabulary (here 300 against 262) proposes
    the target's ids only: "auto" and a limit past them both mean the whole vocabulary, and
    the lab's records name what the proposer does, not what the choice would give the draft."""
    from verispec.generate import make_proposer
    from verispec.lab.bench import Bench, BenchSettings, RunConfig, parse_proposer

    monkeypatch.setattr("verispec.spec.draft_model.AUTO_DRAFT_VOCAB", 140)  # limits more than 280 ids
    tiny.save_hf_model(tmp_path / "draft", "qwen2", seed=2, vocab_size=300)
    target, draft = _load(folder, "float32"), _load(tmp_path / "draft", "float32")
    runner = Bench(target, BenchSettings(), {"draft": draft})
    recorded = {}
    for choice in ("auto", 270, None, 100):
        proposer = make_proposer(draft, target, draft_vocab=choice)
        recorded[choice] = runner.draft_vocab(RunConfig(parse_proposer("draft"), 4, draft_vocab=choice))
        assert proposer.vocab_limit == (recorded[choice] or target.config.vocab_size)
    assert recorded == {"auto": None, 270: None, None: None, 100: 100}


@pytest.mark.parametrize("value", [0, -3, 2.5, "many"])
def test_a_bad_draft_vocabulary_is_a_clear_error(folder, value):
    target = _load(folder, "int8")
    with pytest.raises(VerispecError, match="draft vocabulary"):
        generate(target, PROMPT, draft=target, max_tokens=4, draft_vocab=value)


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_draft_vocabulary_without_a_draft_model_is_a_clear_error(folder, draft):
    target = _load(folder, "int8")
    with pytest.raises(VerispecError, match="applies to a draft model only"):
        generate(target, PROMPT, draft=draft, max_tokens=4, draft_vocab=64)


def test_the_command_line_takes_a_draft_vocabulary(folder, capsys):
    from verispec.cli import main

    args = ["generate", "--model", str(folder), "--draft", str(folder), "--weights", "int4", "--draft-weights", "int4",
            "-n", "12", "--ignore-eos", "--json", PROMPT]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main([*args[:-1], "--draft-vocab", "100", PROMPT]) == 0
    limited = capsys.readouterr().out
    import json

    assert json.loads(limited)["token_ids"] == json.loads(whole)["token_ids"]
    assert json.loads(limited)["spec"]["draft_vocab"] == 100 and json.loads(whole)["spec"]["draft_vocab"] is None
    assert main([*args[:-2], "--draft-vocab", "100", PROMPT]) == 0  # the statistics printed say so
    assert "the draft proposed its first 100 token ids and the context's" in capsys.readouterr().out
    assert main([*args[:-1], "--draft-vocab", "all", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == json.loads(whole)["token_ids"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args[:-1], "--draft-vocab", "0", PROMPT])
    assert exit_info.value.code == 2 and "--draft-vocab" in capsys.readouterr().err
    assert main(["generate", "--model", str(folder), "--draft-vocab", "100", "-n", "4", PROMPT]) == 1
    assert "--draft-vocab limits a draft model's vocabulary, but there is no --draft" in capsys.readouterr().err


def test_the_contexts_ids_stop_at_their_cap(folder, monkeypatch):
    """A long context adds at most MAX_CONTEXT_IDS ids above the limit, Markdown's counted (each
    one's row is read once), and speculation stays exact past the cap."""
    import verispec.spec.draft_model as draft_model

    monkeypatch.setattr(draft_model, "MAX_CONTEXT_IDS", 5)
    target = _load(folder, "float32")
    proposer = DraftModelProposer(target, vocab_limit=64)
    prompt = list(range(100, 140))  # 40 ids above the limit
    plain = generate(target, prompt, max_tokens=16, ignore_eos=True)
    result = generate(target, prompt, draft=proposer, gamma=3, max_tokens=16, ignore_eos=True)
    assert result.token_ids == plain.token_ids
    marks = [t for t in markdown_ids(target.tokenizer) if t >= 64]  # proposed from the start, before the context's
    assert proposer.extra_ids == list(dict.fromkeys(marks + prompt))[:5]
    assert proposer.extra_rows.shape == (5, target.config.hidden_size)
