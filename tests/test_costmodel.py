"""The cost model's formulas, shapes and roofline; calibration; `verispec explain` and `verispec calibrate`."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tiny
from verispec.cli import main
from verispec.config import ModelConfig
from verispec.errors import VerispecError
from verispec.lab import costmodel as cm
from verispec.lab.calibrate import (CalibrationProfile, ModelTiming, load_profile, measure_bandwidth,
                                    time_passes)
from verispec.models import build_model

# ---------------------------------------------------------------- formulas


def test_expected_tokens_per_cycle_known_value():
    assert cm.expected_tokens(0.8, 4) == pytest.approx(3.3616, abs=1e-12)
    assert cm.expected_tokens(0.0, 7) == 1.0
    assert cm.expected_tokens(1.0, 4) == 5.0


@pytest.mark.parametrize("c", [0.01, 0.1, 0.4, 1.0])
def test_no_acceptance_never_pays_when_the_draft_costs_anything(c):
    for gamma in range(1, 33):
        # r(m) = 1 is the most favourable verify pass there is
        assert cm.predict_speedup(0.0, gamma, c, lambda m: 1.0) < 1.0
    costs = cm.RooflineCosts(cm.model_preset("llama3.1-8b"), cm.model_preset("llama3.2-1b"),
                             cm.hardware_preset("h200"))
    assert costs.c > 0
    assert all(cm.predict(costs, 0.0, g).speedup < 1.0 for g in range(1, 17))


def test_the_draft_is_costed_in_the_targets_format_unless_told():
    """As the engine loads a draft: its own --draft-weights, else the target's --weights, else its default."""
    target, draft = cm.model_preset("qwen2.5-coder-1.5b"), cm.model_preset("qwen2.5-coder-0.5b")
    h200 = cm.hardware_preset("h200")

    def draft_format(**weights) -> str:
        costs = cm.RooflineCosts(target, draft, h200, **weights)
        return costs.weight_format(costs.draft).name

    assert draft_format() == "float32"
    assert draft_format(target_weights="int4") == "int4"
    assert draft_format(target_weights="int4", draft_weights="bfloat16") == "bfloat16"
    cheaper = cm.RooflineCosts(target, draft, h200, target_weights="int4")
    assert cheaper.c < cm.RooflineCosts(target, draft, h200, target_weights="int4", draft_weights="float32").c


def test_distinct_experts_touched_by_a_verify_pass():
    assert cm.expected_distinct_experts(128, 8, 9) == pytest.approx(56.4, abs=0.05)
    assert cm.expected_distinct_experts(128, 8, 1) == pytest.approx(8.0)
    assert 127 < cm.expected_distinct_experts(128, 8, 200) <= 128
    assert cm.expected_distinct_experts(0, 0, 9) == 0.0


def test_r_of_m_can_be_a_callable_a_sequence_or_a_mapping():
    curve = [1.0, 1.3, 1.5, 1.9, 2.2]
    by_callable = cm.predict_speedup(0.7, 4, 0.2, lambda m: curve[m - 1])
    assert cm.predict_speedup(0.7, 4, 0.2, curve) == by_callable
    assert cm.predict_speedup(0.7, 4, 0.2, {5: 2.2}) == by_callable
    assert by_callable == pytest.approx(cm.expected_tokens(0.7, 4) / (4 * 0.2 + 2.2))
    assert cm.predict_speedup(0.7, 0, 0.2, curve) == 1.0


def test_the_draft_pays_a_two_position_step_after_a_fully_kept_round():
    r = {5: 1.5}
    assert cm.predict_speedup(1.0, 4, 0.2, r, draft_r2=2.0) == pytest.approx(5 / (0.2 * 5 + 1.5))
    assert cm.predict_speedup(0.0, 4, 0.2, r, draft_r2=2.0) == pytest.approx(1 / (0.2 * 4 + 1.5))
    assert cm.predict_speedup(0.5, 4, 0.2, r, draft_r2=1.0) == cm.predict_speedup(0.5, 4, 0.2, r)
    # the draft's prompt reading adds its share to every token's cost
    assert 1 / cm.predict_speedup(0.5, 4, 0.2, r, prompt_cost=0.25) == pytest.approx(
        1 / cm.predict_speedup(0.5, 4, 0.2, r) + 0.25)
    costs = cm.MeasuredCosts({1: 1.0, 5: 1.5}, draft_step_s=0.2, draft_two_s=0.4)
    assert costs.draft_r2 == pytest.approx(2.0)
    prediction = cm.predict(costs, 1.0, 4)
    assert prediction.cycle_cost == pytest.approx(0.2 * 5 + 1.5)
    assert prediction.speedup == pytest.approx(5 / 2.5)


def test_alpha_is_estimated_from_judged_drafts_not_all_drafted():
    # 3 rounds of γ = 4: kept 4 (bonus), kept 1 then rejected, rejected at once
    assert cm.alpha_from_counts(accepted=5, rejected=2) == pytest.approx(5 / 7)
    assert cm.alpha_from_counts(0, 0) == 0.0


def test_best_gamma_grows_with_acceptance_on_a_cheap_verify_pass():
    costs = cm.MeasuredCosts({m: 0.010 * (1 + 0.01 * (m - 1)) for m in range(1, 33)}, draft_step_s=0.001)
    gammas = [cm.best_gamma(costs, alpha).gamma for alpha in (0.3, 0.6, 0.9, 0.97)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]
    assert cm.best_gamma(costs, 0.9).speedup > 2


def test_weight_formats_count_their_scales():
    assert cm.WEIGHT_FORMATS["float32"].bytes_per_weight == 4
    assert cm.WEIGHT_FORMATS["bfloat16"].bytes_per_weight == 2
    assert cm.WEIGHT_FORMATS["int4"].bytes_per_weight == pytest.approx(0.5 + 4 / 32)
    assert cm.WEIGHT_FORMATS["q8_0"].bytes_per_weight == pytest.approx(34 / 32)
    assert cm.WEIGHT_FORMATS["q4_k"].bytes_per_weight == pytest.approx(144 / 256)
    assert 1 < cm.WEIGHT_FORMATS["int8"].bytes_per_weight < 1.01


# ---------------------------------------------------------------- shapes


def _parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family,overrides", [("qwen2", {}), ("qwen3", {}), ("llama", {"tie_word_embeddings": True})])
def test_shapes_from_config_match_the_built_model(family, overrides):
    config = ModelConfig.from_hf(tiny.hf_config(family, **overrides).to_dict())
    with torch.device("meta"):
        model = build_model(config)
    shape = cm.shape_from_config(config)
    assert shape.total_params == _parameter_count(model)
    assert shape.attention_layers == config.num_hidden_layers
    assert shape.kv_heads == config.num_key_value_heads


def test_shapes_from_an_hf_folder_and_a_gguf_file_match_the_weights(tmp_path):
    reference = tiny.save_hf_model(tmp_path / "hf", "qwen2", seed=1)
    total = _parameter_count(reference)
    from_folder = cm.shape_from_hf_folder(tmp_path / "hf")
    assert from_folder.total_params == total
    assert "safetensors headers" in from_folder.source
    tiny.write_gguf(tmp_path / "tiny.gguf", reference, "qwen2")
    from_gguf = cm.resolve_shape(str(tmp_path / "tiny.gguf"))
    assert from_gguf.total_params == total
    assert from_gguf.active_params == from_folder.active_params
    assert (from_gguf.attention_layers, from_gguf.kv_heads, from_gguf.head_dim) == (2, 2, 16)


def test_presets_have_the_sizes_their_names_say():
    sizes = {  # name: (total, active) in billions, as published (the 128-expert variant: see its preset)
        "seed-35b-a3b": (35, 3), "seed-35b-a3b-128e": (35, 3.9), "seed-0.8b": (0.8, 0.8), "seed-4b": (4, 4), "seed-9b": (9, 9),
        "qwen3-30b-a3b": (30.5, 3.3), "qwen2.5-coder-1.5b": (1.5, 1.5), "llama3.1-8b": (8, 8),
    }
    for name, (total, active) in sizes.items():
        shape = cm.model_preset(name)
        assert shape.total_params / 1e9 == pytest.approx(total, rel=0.15), name
        assert shape.active_params / 1e9 == pytest.approx(active, rel=0.15), name
    hybrid = cm.model_preset("seed-9b")
    assert hybrid.attention_layers == 8 and hybrid.recurrent_state_bytes > 0


def test_a_moe_verify_pass_reads_every_distinct_expert_it_touches():
    shape = cm.model_preset("qwen3-30b-a3b")
    fmt = cm.WEIGHT_FORMATS["bfloat16"]
    extra = shape.weight_bytes(9, fmt) - shape.weight_bytes(1, fmt)
    expected = shape.moe_layers * (cm.expected_distinct_experts(128, 8, 9) - 8) * shape.expert_params * 2
    assert extra == pytest.approx(expected)
    costs = cm.RooflineCosts(shape, cm.model_preset("qwen3-0.6b"), cm.hardware_preset("m2-ultra"))
    assert costs.r(9) > 3  # ~56 of 128 experts against 8


def test_a_dense_pass_stays_flat_until_the_ridge_point():
    hardware = cm.Hardware("test", bandwidth=1e12, peak_flops=100e12)  # ridge 100 FLOP/byte
    costs = cm.RooflineCosts(cm.model_preset("llama3.1-8b"), cm.model_preset("llama3.2-1b"), hardware,
                             context=1)
    assert costs.r(2) == pytest.approx(1.0, abs=0.01)
    assert costs.pass_cost(costs.target, 2).bound == "memory"
    # bf16: 1 FLOP per byte per position, so past ~100 positions the pass is compute-bound
    assert costs.pass_cost(costs.target, 400).bound == "compute"
    assert costs.r(400) > 3


def test_measured_costs_interpolate_and_extrapolate():
    costs = cm.MeasuredCosts({1: 1.0, 2: 1.5, 4: 2.5}, draft_step_s=0.25)
    assert costs.c == 0.25
    assert costs.r(3) == pytest.approx(2.0)
    assert costs.r(6) == pytest.approx(3.5)  # along the last slope
    with pytest.raises(VerispecError):
        cm.MeasuredCosts({2: 1.0}, draft_step_s=0.1)


def test_draft_prefill_is_interpolated_and_spread_over_decoded_tokens():
    costs = cm.MeasuredCosts({1: 0.1}, draft_step_s=0.02, draft_prefill_s={32: 0.04, 128: 0.12, 512: 0.6})
    assert costs.draft_prefill(32) == pytest.approx(0.04)
    assert costs.draft_prefill(80) == pytest.approx(0.08)  # halfway between 32 and 128
    assert costs.draft_prefill(1024) == pytest.approx(0.6 + 512 * (0.48 / 384))  # the last slope
    assert costs.prompt_cost(128, 60) == pytest.approx(0.12 / 0.1 / 60)
    assert cm.MeasuredCosts({1: 0.1}, draft_step_s=0.02).prompt_cost(128, 60) == 0.0


def test_bad_hardware_is_refused():
    with pytest.raises(VerispecError, match="bandwidth"):
        cm.Hardware("bad", bandwidth=-1, peak_flops=1e12)
    with pytest.raises(VerispecError, match="unknown hardware preset"):
        cm.hardware_preset("pdp-11")
    with pytest.raises(VerispecError, match="unknown model preset"):
        cm.model_preset("gpt-9")


# ---------------------------------------------------------------- explain


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("target", ["seed-35b-a3b", "seed-35b-a3b-128e"])
def test_explain_the_seed_setting_at_almost_no_acceptance(capsys, target):
    code = main(["explain", "--target", target, "--draft", "seed-0.8b", "--hardware", "m2-ultra",
                 "--alpha", "0.002"])
    out = _flat(capsys.readouterr().out)
    assert code == 0
    assert "at α = 0.002: speed-up < 1 for every γ" in out
    # the reason, in one sentence: a cycle yields ~1 token and costs more than one target step
    reason = out[out.index("At α = 0.002"):]
    assert reason.count(". ") == 0 and reason.endswith(".")
    assert "yields 1.00 token(s)" in reason and "target steps" in reason
    costs = cm.RooflineCosts(cm.model_preset(target), cm.model_preset("seed-0.8b"),
                             cm.hardware_preset("m2-ultra"))
    assert all(cm.predict(costs, 0.002, g).speedup < 1 for g in (1, 2, 4, 8, 16))


def test_explain_prints_the_pass_costs_and_the_grid(capsys):
    assert main(["explain", "--target", "qwen3-30b-a3b", "--draft", "qwen3-0.6b", "--bandwidth", "800",
                 "--flops", "27"]) == 0
    out = capsys.readouterr().out
    for text in ("weights GB", "experts", "t(m) ms", "predicted speed-up", "best γ", "c = "):
        assert text in out
    assert "56.4" in out  # distinct experts at m = 9
    assert "800.0 GB/s" in out


@pytest.mark.parametrize("argv,message", [
    (["--target", "no-such-model", "--draft", "seed-0.8b"], "neither a model file"),
    (["--target", "seed-9b", "--draft", "seed-0.8b", "--profile", "/nonexistent/profile.json"],
     "no calibration profile"),
    (["--target", "seed-9b", "--draft", "seed-0.8b", "--bandwidth", "-800"], "--bandwidth must be a positive"),
    (["--target", "seed-9b", "--draft", "seed-0.8b", "--flops", "0"], "--flops must be a positive"),
])
def test_explain_bad_inputs_are_one_line_errors(capsys, argv, message):
    assert main(["explain", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and message in err
    assert "Traceback" not in err


def test_a_damaged_profile_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    assert main(["explain", "--target", "seed-9b", "--draft", "seed-0.8b", "--profile", str(bad)]) == 1
    assert "not a JSON calibration profile" in capsys.readouterr().err
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(VerispecError, match="not a verispec calibration profile"):
        load_profile(bad)


def test_explain_rejects_an_acceptance_outside_zero_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--target", "seed-9b", "--draft", "seed-0.8b", "--alpha", "1.5"])
    assert exit_info.value.code == 2
    assert "acceptance rate in [0, 1]" in capsys.readouterr().err


# ---------------------------------------------------------------- calibration


def _tiny_model(vocab: int = 16384, hidden: int = 256) -> torch.nn.Module:
    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * hidden,
                         max_position_embeddings=512)
    model = build_model(config)
    tiny.randomize(model, seed=0)
    return model.eval()


def test_time_passes_gives_a_sane_verify_cost_curve():
    model = _tiny_model()
    positions = [1, 4, 16, 64]  # spaced widely, so that a busy machine's noise cannot reorder them
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # threads that wait on each other at every op time the machine's load, not the model
    try:
        seconds = time_passes(model, positions, context=16, repeats=7)
    finally:
        torch.set_num_threads(threads)
    r = ModelTiming("tiny", "float32", 16, positions, seconds).r
    assert r[0] == 1.0
    assert all(math.isfinite(x) and x > 0.5 for x in r)
    # monotone-ish: a busy machine can swap two small sizes, but 64 rows through a 16384-word
    # output layer cost clearly more than any of them
    assert r[-1] == max(r) and r[-1] > 2


def test_time_passes_leaves_the_cache_where_it_found_it():
    model = _tiny_model(vocab=512, hidden=64)
    calls = []
    original = model.forward

    def spy(tokens, cache, last_only=False):
        calls.append(cache.length)
        return original(tokens, cache, last_only)

    model.forward = spy
    time_passes(model, [1, 3], context=5, repeats=2)
    assert calls[0] == 0 and set(calls[1:]) == {5}  # every timed pass starts after the same context


def test_bandwidth_is_measured_in_bytes_per_second():
    copy_bw, read_bw = measure_bandwidth(size_bytes=8 * 2**20, repeats=2)
    assert 1e8 < copy_bw < 1e13 and 1e8 < read_bw < 1e13


def test_profile_round_trip(tmp_path):
    profile = CalibrationProfile({"processor": "test"}, 2e10, 1.9e10, 1e11,
                                 ModelTiming("t", "float32", 64, [1, 2, 3], [0.1, 0.15, 0.18], 10),
                                 ModelTiming("d", "float32", 64, [1, 2], [0.03, 0.05], 3))
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = load_profile(path)
    assert loaded == profile
    costs = loaded.costs()
    assert costs.c == pytest.approx(0.3)
    assert costs.r(3) == pytest.approx(1.8)
    assert loaded.hardware().bandwidth == 1.9e10


def test_calibrate_command_on_a_tiny_model_then_explain_with_it(tmp_path, capsys):
    folder = tmp_path / "tiny-qwen2"
    tiny.save_hf_model(folder, "qwen2", seed=2)
    out_file = tmp_path / "profile.json"
    assert main(["calibrate", "--model", str(folder), "--draft", str(folder), "--max-m", "4", "--repeats", "2",
                 "--context", "8", "--buffer-mib", "8", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "r(m)" in printed and "c = t_draft(1) / t_target(1)" in printed
    profile = load_profile(out_file)
    assert profile.target.positions == [1, 2, 3, 4]
    assert profile.target.r[0] == 1.0 and profile.c > 0
    # the draft's prompt reading, at lengths the tiny model's context holds, grows with the length
    assert "reads a prompt once per request" in printed
    assert profile.draft.prefill_lengths and profile.draft.prefill_seconds[-1] > profile.draft.prefill_seconds[0] > 0
    assert profile.machine["cores"] >= 1 and profile.machine["torch"] == torch.__version__
    assert main(["explain", "--target", str(folder), "--draft", str(folder), "--profile", str(out_file)]) == 0
    assert "measured in" in capsys.readouterr().out


def test_calibrate_times_the_draft_with_its_vocabulary(tmp_path, capsys):
    """`--draft-vocab 64` times the draft's steps computing the first 64 ids' logits, as decoding
    with it would; the profile says so, and counts the output rows it skips as not read."""
    folder = tmp_path / "tiny-qwen2"
    tiny.save_hf_model(folder, "qwen2", seed=2)
    profiles = {}
    for vocab in ("all", "64"):
        out_file = tmp_path / f"{vocab}.json"
        assert main(["calibrate", "--model", str(folder), "--draft", str(folder), "--max-m", "2", "--repeats", "1",
                     "--context", "8", "--buffer-mib", "8", "--draft-vocab", vocab, "--out", str(out_file)]) == 0
        profiles[vocab] = load_profile(out_file)
    assert "logits of the first 64 ids" in capsys.readouterr().out
    whole, limited = profiles["all"].draft, profiles["64"].draft
    assert whole.vocab is None and limited.vocab == 64 and profiles["64"].target.vocab is None
    hidden, vocab = 64, tiny.VOCAB  # the tiny qwen2's untied output layer, float32
    assert whole.weight_bytes - limited.weight_bytes == (vocab - 64) * hidden * 4


# ---------------------------------------------------------------- bad paths and values, caught before any work


@pytest.fixture
def no_measuring(monkeypatch):
    """Make any measuring fail loudly, to prove that a bad --out is caught before it."""
    def measured(*args, **kwargs):
        raise AssertionError("measured before checking --out")
    monkeypatch.setattr("verispec.lab.calibrate.measure_bandwidth", measured)


@pytest.mark.parametrize("where,message", [
    ("no-such-folder/profile.json", "there is no folder"),
    (".", "is a folder; give a file to save the profile to"),
    ("a-file/profile.json", "is a file, not a folder"),
])
def test_calibrate_checks_out_before_measuring(tmp_path, capsys, no_measuring, where, message):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / where
    assert main(["calibrate", "--buffer-mib", "1", "--repeats", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("option", [["--context", "4000"], ["--context", "8", "--max-m", "5000"]])
def test_calibrate_refuses_passes_beyond_the_models_context_before_measuring(tmp_path, capsys, no_measuring, option):
    folder = tmp_path / "tiny-qwen2"
    tiny.save_hf_model(folder, "qwen2", seed=2)
    capsys.readouterr()  # what writing the model printed
    assert main(["calibrate", "--model", str(folder), "--repeats", "1", *option]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and "lower --context or --max-m" in err and err.count("\n") == 1


def test_saving_a_profile_to_a_folder_is_a_clear_error(tmp_path):
    profile = CalibrationProfile({"processor": "test"}, 2e10, 1.9e10, 1e11)
    with pytest.raises(VerispecError, match="is a folder"):
        profile.save(tmp_path)


def test_explain_with_a_folder_as_profile_is_one_line(tmp_path, capsys):
    assert main(["explain", "--target", "seed-9b", "--draft", "seed-0.8b", "--profile", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("verispec: error:") and "is a folder" in err and err.count("\n") == 1


@pytest.mark.parametrize("option", ["--overhead-ms", "--alpha", "--bandwidth", "--flops"])
@pytest.mark.parametrize("value", ["nan", "inf", "NaN", "infinity"])
def test_explain_refuses_nan_and_inf_before_printing(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--target", "seed-9b", "--draft", "seed-0.8b", f"{option}={value}"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and f"argument {option}" in err and "expected a finite number" in err
