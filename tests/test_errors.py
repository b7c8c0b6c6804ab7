"""Every user mistake gets one clear message: from the API as a VerispecError, from the CLI as one line."""

from __future__ import annotations

import json

import pytest

import tiny
from verispec.cli import main
from verispec.errors import (ContextOverflowError, CorruptModelError, ModelNotFoundError,
                             UnsupportedArchitectureError)
from verispec.generate import generate
from verispec.loading import load_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    ref = tiny.save_hf_model(path, "qwen2", max_position_embeddings=64)
    tiny.write_gguf(path / "model.gguf", ref, "qwen2")
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits for bad option values
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def test_missing_path(capsys):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        load_model("/nonexistent/model.gguf")
    code, _, err = run_cli(capsys, "generate", "--model", "/nonexistent/model.gguf", "hi")
    assert code == 1 and "no model at '/nonexistent/model.gguf'" in err


def test_unknown_model_name_lists_the_demo_names(capsys):
    code, _, err = run_cli(capsys, "generate", "--model", "qwen-9000", "hi")
    assert code == 1 and "qwen2.5-coder-1.5b" in err


def test_unsupported_architecture_is_named(tmp_path, folder, capsys):
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="'gpt_neox' is not supported; supported: .*qwen2"):
        load_model(tmp_path)


def test_truncated_gguf(tmp_path, folder, capsys):
    data = (folder / "model.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptModelError, match="truncated"):
        load_model(cut)
    code, _, err = run_cli(capsys, "generate", "--model", str(cut), "hi")
    assert code == 1 and "truncated" in err


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(CorruptModelError, match="not a readable GGUF"):
        load_model(bad)


def test_not_a_model_file(tmp_path):
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(CorruptModelError, match="neither a GGUF file nor a Hugging Face folder"):
        load_model(other)


def test_truncated_safetensors(tmp_path, folder):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="corrupt or truncated safetensors"):
        load_model(tmp_path)


def test_missing_weights_are_named(tmp_path, folder):
    from safetensors.torch import load_file, save_file
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CorruptModelError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_prompt_longer_than_context(folder, capsys):
    model = load_model(folder)
    with pytest.raises(ContextOverflowError, match="the model's context holds 64"):
        generate(model, "x" * 100)
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "x" * 100)
    assert code == 1 and "shorten the prompt" in err


def test_generation_stops_at_the_context_end(folder):
    result = generate(load_model(folder), "x" * 60, max_tokens=50, ignore_eos=True)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


@pytest.mark.parametrize("argv,message", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-tokens", "-1"], "--max-tokens"),
    (["--gamma", "x"], "--gamma"),
    (["--draft", "ngram", "--gamma", "0"], "--gamma"),  # drafting nothing is not speculation
    (["--draft", "ngram", "--gamma", "33"], "--gamma"),
    (["--weights", "int3"], "--weights"),
    (["--logit-bias", "13"], "--logit-bias"),
    (["--logit-bias", "x=1"], "--logit-bias"),
    (["--logit-bias", "13=nan"], "--logit-bias"),
])
def test_bad_option_values(folder, capsys, argv, message):
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), *argv, "hi")
    assert code == 2 and message in err


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("argv,message", [
    (["--draft-weights", "int4"], "there is no --draft"),
    (["--draft", "ngram", "--draft-weights", "int4"], "prompt lookup loads no model"),
    (["--adaptive"], "there is no --draft"),
    (["--no-lookup"], "there is no draft model"),
    (["--draft", "ngram", "--no-lookup", "--adaptive"], "there is no draft model"),
    (["--draft", "some-draft", "--no-lookup"], "--adaptive cost is not on"),
])
def test_draft_options_without_a_draft_are_refused_before_loading(folder, capsys, monkeypatch, command, argv,
                                                                    message):
    """Ignored, they would leave the user believing a draft ran (or ran in that format)."""
    import verispec.loading

    monkeypatch.setattr(verispec.loading, "load_model", lambda *a, **k: pytest.fail("loaded a model first"))
    prompt = ["hi"] if command == "generate" else []  # before the options: --adaptive takes an optional value
    code, _, err = run_cli(capsys, command, "--model", str(folder), *prompt, *argv)
    assert code == 1 and message in err and err.count("\n") == 1


def test_calibrate_refuses_a_draft_format_without_a_draft(folder, capsys):
    code, _, err = run_cli(capsys, "calibrate", "--model", str(folder), "--draft-weights", "int4")
    assert code == 1 and "there is no --draft" in err


def test_bad_dtype_and_device(folder):
    from verispec.errors import VerispecError
    with pytest.raises(VerispecError, match="unknown dtype"):
        load_model(folder, dtype="float8")
    with pytest.raises(VerispecError, match="device"):
        load_model(folder, device="tpu")
    for device in ("mps", "meta"):  # real torch devices the engine does not run on
        with pytest.raises(VerispecError, match=f"unknown device '{device}'; use cpu or cuda"):
            load_model(folder, device=device)


def _copy_of(folder, tmp_path):
    import shutil
    copy = tmp_path / "model"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("*.gguf"))
    return copy


@pytest.mark.parametrize("config,message", [
    ({}, "no vocab_size, hidden_size, num_hidden_layers, num_attention_heads"),
    ([1, 2], "expected a JSON object"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
])
def test_broken_config_json_is_named(folder, tmp_path, capsys, config, message):
    copy = _copy_of(folder, tmp_path)
    raw = json.loads((copy / "config.json").read_text())
    changed = config if not isinstance(config, dict) or not config else {**raw, **config}
    (copy / "config.json").write_text(json.dumps(changed))
    with pytest.raises(CorruptModelError, match=message):
        load_model(copy)
    code, _, err = run_cli(capsys, "generate", "--model", str(copy), "-n", "2", "hi")
    assert code == 1 and "config.json" in err and message.split(",")[0] in err


def test_broken_tokenizer_config_is_named(folder, tmp_path):
    copy = _copy_of(folder, tmp_path)
    (copy / "tokenizer_config.json").write_text("{bad")
    with pytest.raises(CorruptModelError, match="tokenizer_config.json: invalid JSON"):
        load_model(copy)


def test_gguf_without_required_metadata_is_named(tmp_path):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "no-heads.gguf"), "qwen2")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    tiny.add_gguf_tokenizer(writer)
    writer.add_tensor("token_embd.weight", np.zeros((262, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CorruptModelError, match="no qwen2.attention.head_count in the GGUF metadata"):
        load_model(tmp_path / "no-heads.gguf")


def test_broken_chat_template_is_one_line(folder, tmp_path, capsys):
    from verispec.errors import VerispecError
    copy = _copy_of(folder, tmp_path)
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m.content "
    (copy / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(VerispecError, match="chat template failed"):
        load_model(copy).tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    code, _, err = run_cli(capsys, "generate", "--model", str(copy), "--chat", "-n", "2", "hi")
    assert code == 1 and "chat template failed" in err


def test_seed_out_of_range_is_one_line(folder, capsys):
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "-t", "1", "--seed",
                           "99999999999999999999999", "-n", "2", "hi")
    assert code == 1 and "seed must be an integer from" in err


@pytest.mark.parametrize("argv,option", [
    (["-t", "nan"], "--temperature"),
    (["-t", "inf"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--top-p=-inf"], "--top-p"),
])
def test_nan_and_inf_option_values_are_refused_when_parsed(folder, capsys, argv, option):
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), *argv, "-n", "2", "hi")
    assert code == 2 and option in err and "expected a finite number" in err


@pytest.mark.parametrize("options,message", [
    ({"prompt": [1, 99999]}, "token id 99999 is outside the model's vocabulary"),
    ({"prompt": [1, -1]}, "token id -1 is outside"),
    ({"prompt": [1, "a"]}, "the prompt must be text, a list of token ids"),
    ({"prompt": None}, "the prompt must be text"),
    ({"temperature": float("nan")}, "temperature must be a number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a number >= 0"),
    ({"top_k": 2.5}, "top-k must be a whole number"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"max_tokens": 2.5}, "max tokens must be a whole number"),
    ({"draft": "ngram", "gamma": 2.5}, "gamma must be a whole number"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"stop": ["x", None]}, "stop must be a string or a list of strings"),
    ({"logit_bias": {99999: 1.0}}, "token id 99999 is outside the model's vocabulary"),
    ({"logit_bias": {"5": 1.0}}, "a logit bias is keyed by a token id"),
    ({"logit_bias": {5: 101}}, "a logit bias must be a number from -100 to 100"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "names a token id twice"),
    ({"logit_bias": 5}, "a logit bias maps token ids to amounts"),
    ({"stop_token_ids": [3, "a"]}, "stop token ids must be a list of token ids"),
    ({"stop_token_ids": 3}, "stop token ids must be a list of token ids"),
    ({"stop_token_ids": [99999]}, "token id 99999 is outside the model's vocabulary"),
    ({"min_tokens": 3}, "min tokens must be a whole number from 0 to max tokens"),
    ({"min_tokens": -1}, "min tokens must be a whole number from 0 to max tokens"),
])
def test_api_arguments_of_the_wrong_kind_are_named(folder, options, message):
    from verispec.errors import VerispecError
    model = load_model(folder)
    options = {"prompt": "hi", "max_tokens": 2, **options}
    with pytest.raises(VerispecError, match=message):
        generate(model, options.pop("prompt"), **options)


def test_a_single_stop_string_is_one_string(folder):
    model = load_model(folder)
    plain = generate(model, "hi", max_tokens=12, ignore_eos=True)
    # the old reading took a string as its characters: it would stop at the first one
    never = plain.text[0] + "\x01"
    result = generate(model, "hi", max_tokens=12, ignore_eos=True, stop=never)
    assert result.finish_reason == "length" and result.text == plain.text
    assert generate(model, "hi", max_tokens=12, ignore_eos=True, stop=plain.text[2:4]).finish_reason == "stop"


def test_a_draft_that_cannot_read_the_targets_token_drafts_nothing_after_it(tmp_path):
    tiny.save_hf_model(tmp_path / "target", "qwen2", seed=1, vocab_size=300)  # 38 padding rows
    tiny.save_hf_model(tmp_path / "draft", "qwen2", seed=4)  # the same tokenizer, 262 rows
    target, draft = load_model(tmp_path / "target"), load_model(tmp_path / "draft")
    plain = generate(target, "the cat sat", max_tokens=16, ignore_eos=True)
    assert any(i >= 262 for i in plain.token_ids)  # random weights do choose padding rows
    spec = generate(target, "the cat sat", max_tokens=16, ignore_eos=True, draft=draft, gamma=3)
    assert spec.token_ids == plain.token_ids
    assert spec.spec.gammas[-1] == 0  # plain rounds once the draft could not read the context


@pytest.fixture
def demo_copy(folder, tmp_path, monkeypatch):
    """A demo model entry whose file is the tiny GGUF, in a models folder of its own."""
    import hashlib

    from verispec.loading import demo_models

    models = tmp_path / "models"
    models.mkdir()
    data = (folder / "model.gguf").read_bytes()
    (models / "tiny.gguf").write_bytes(data)
    entry = demo_models.DemoModel(name="tiny-demo", filename="tiny.gguf", description="tiny", packages=(),
                                  member_glob=".gguf", sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    monkeypatch.setitem(demo_models.DEMO_MODELS, "tiny-demo", entry)
    monkeypatch.setenv("VERISPEC_MODELS", str(models))
    return models / "tiny.gguf"


def test_a_damaged_demo_model_is_refused_not_decoded(demo_copy, capsys):
    assert generate(load_model("tiny-demo"), "hi", max_tokens=2).token_ids  # intact: loads, and is stamped
    data = bytearray(demo_copy.read_bytes())
    data[-64:] = bytes(255 - b for b in data[-64:])  # same size, other bytes: it would load and talk nonsense
    demo_copy.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="is damaged: its SHA-256 is not the pinned one"):
        load_model("tiny-demo")
    code, _, err = run_cli(capsys, "generate", "--model", "tiny-demo", "-n", "2", "hi")
    assert code == 1 and "models --install" in err
    code, out, _ = run_cli(capsys, "models")
    assert code == 0 and "damaged" in out


def test_installing_over_something_in_the_way_is_one_line(demo_copy, tmp_path, monkeypatch, capsys):
    from verispec.loading import demo_models
    demo_copy.unlink()
    demo_copy.mkdir()  # a folder where the file goes: refused before any download
    monkeypatch.setattr(demo_models, "_download_wheels", lambda *a: pytest.fail("nothing should download"))
    with pytest.raises(demo_models.VerispecError, match="is in the way of tiny-demo"):
        demo_models.install("tiny-demo")
    monkeypatch.setenv("VERISPEC_MODELS", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(demo_models.VerispecError, match="cannot make the models folder"):
        demo_models.install("tiny-demo")
