"""Hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): logits against transformers,
exact rollback of the recurrent state, and speculation that changes nothing."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

import tiny
from verispec import kernels
from verispec.errors import RollbackError
from verispec.events import Finished
from verispec.generate import generate, stream
from verispec.loading import load_model
from verispec.models.hybrid_cache import HybridCache

PROMPT = [5, 77, 100, 3, 9, 200, 42, 17, 5, 77, 100]
MAX_TOKENS = 24
LOGIT_TOL = 1e-4
STATE_TOL = 1e-5

COMMON = dict(vocab_size=tiny.VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              max_position_embeddings=256, eos_token_id=tiny.EOS_ID, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


def hybrid_config(family: str, **overrides):
    """A tiny text config: 3 delta-net layers then 1 attention layer; 2 key heads serve 4 value heads."""
    import transformers

    kwargs = dict(COMMON)
    if family == "qwen3_5":
        cls, kwargs["intermediate_size"] = transformers.Qwen3_5TextConfig, 96
    elif family == "qwen3_5_moe":
        cls = transformers.Qwen3_5MoeTextConfig
        kwargs.update(MOE)
    else:  # experts on every second layer, a dense MLP on the others
        cls = transformers.Qwen3NextConfig
        kwargs.update(MOE, intermediate_size=96, decoder_sparse_step=2)
    kwargs.update(overrides)
    return cls(**kwargs)


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Random weights with activations of order one, so float32 rounding stays far below the tolerances.

    The (1 + weight) norms get weights near 0, the gated norm near 1, and A_log near -3:
    a slow decay, so the recurrent state remembers many positions and a wrong one shows.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:
                p.copy_(0.1 * noise)
            elif name.endswith("A_log"):
                p.copy_(-3.0 + 0.5 * noise)
            else:
                p.copy_(scale * noise)


def save_hybrid(folder: Path, config, seed: int = 0):
    """Build, randomise and save a transformers model of `config`; returns it."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if hasattr(config, "text_config"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tiny.write_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (folder, transformers model, our loaded model)."""
    out = {}
    for seed, family in enumerate(FAMILIES, start=1):
        folder = tmp_path_factory.mktemp(family)
        hf = save_hybrid(folder, hybrid_config(family), seed)
        out[family] = (folder, hf, load_model(folder))
    return out


def random_ids(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, tiny.VOCAB, (1, count), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ against transformers

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(saved, family):
    _, hf, ours = saved[family]
    ids = random_ids(40)
    with torch.no_grad():
        expected = hf(ids).logits
    cache = ours.model.new_cache(64)
    with torch.inference_mode():
        prefill = ours.model(ids[:, :30], cache)
        steps = torch.cat([ours.model(ids[:, i:i + 1], cache) for i in range(30, 34)], dim=1)
        multi = ours.model(ids[:, 34:40], cache)
    assert (prefill - expected[:, :30]).abs().max() <= LOGIT_TOL
    assert (steps - expected[:, 30:34]).abs().max() <= LOGIT_TOL
    assert (multi - expected[:, 34:40]).abs().max() <= LOGIT_TOL


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_image_text_checkpoint_loads_its_text_part(tmp_path, family):
    import transformers

    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    cls = transformers.Qwen3_5Config if family == "qwen3_5" else transformers.Qwen3_5MoeConfig
    text = hybrid_config(family).to_dict()
    config = cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    hf = save_hybrid(tmp_path, config)
    ours = load_model(tmp_path)
    assert not [name for name in ours.model.state_dict() if "visual" in name]
    ids = random_ids(12, seed=3)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
    with torch.inference_mode():
        got = ours.model(ids, ours.model.new_cache(16))
    assert (got - expected).abs().max() <= LOGIT_TOL


def test_fused_expert_checkpoint_loads(saved, tmp_path):
    """Published Qwen3.5-MoE checkpoints stack experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _, ours = saved["qwen3_5_moe"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, tmp_path / name)
    state = load_file(str(folder / "model.safetensors"))
    fused = {}
    for layer in range(COMMON["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"

        def stack(projection: str) -> torch.Tensor:
            return torch.stack([state.pop(f"{prefix}.{e}.{projection}.weight") for e in range(MOE["num_experts"])])

        fused[f"{prefix}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        fused[f"{prefix}.down_proj"] = stack("down_proj")
    save_file({**state, **fused}, str(tmp_path / "model.safetensors"))
    reloaded = load_model(tmp_path)
    ids = random_ids(10, seed=4)
    with torch.inference_mode():
        got = reloaded.model(ids, reloaded.model.new_cache(16))
        expected = ours.model(ids, ours.model.new_cache(16))
    assert (got - expected).abs().max() <= STATE_TOL  # same weights; only their memory layout differs


@pytest.mark.parametrize("family, sparse_layers", [("qwen3_5_moe", 4), ("qwen3_next", 2)])
def test_experts_touched(saved, family, sparse_layers):
    model = saved[family][2].model
    cache = model.new_cache(32)
    with torch.inference_mode():
        model(random_ids(1), cache)
        assert model.experts_touched() == [MOE["num_experts_per_tok"]] * sparse_layers
        model(random_ids(9, seed=5), cache)
    touched = model.experts_touched()
    assert len(touched) == sparse_layers
    assert all(MOE["num_experts_per_tok"] <= t <= MOE["num_experts"] for t in touched)
    assert max(touched) > MOE["num_experts_per_tok"]  # nine positions route to more experts than one


# ------------------------------------------------------------------ rollback

def fresh_states(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = model.new_cache(128)
    if ids:
        with torch.inference_mode():
            model(torch.tensor([ids]), cache)
    return cache.linear_states()


def assert_states_equal(got, expected) -> None:
    assert len(got) == len(expected) == 3
    for (conv, state), (conv_ref, state_ref) in zip(got, expected):
        assert (conv - conv_ref).abs().max() <= STATE_TOL
        assert (state - state_ref).abs().max() <= STATE_TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_restores_the_states_of_a_fresh_run(saved, family):
    """Verify passes of 1..17 positions and runs of single draft steps, rolled back to every kind of point."""
    model = saved[family][2].model
    gen = torch.Generator().manual_seed(7)
    tokens = random_ids(12, seed=6)[0].tolist()
    cache = model.new_cache(128)
    with torch.inference_mode():
        model(torch.tensor([tokens]), cache)
        for round_index in range(12):
            start = len(tokens)
            fed = torch.randint(0, tiny.VOCAB, (int(torch.randint(1, 18, (), generator=gen)),), generator=gen)
            if round_index % 3 == 2:  # the draft's way: one position at a time
                for token in fed.tolist():
                    model(torch.tensor([[token]]), cache)
            else:
                model(fed[None], cache)
            kept = start + int(torch.randint(0, len(fed) + 1, (), generator=gen))
            tokens = tokens + fed.tolist()
            cache.rollback(kept)
            tokens = tokens[:kept]
            assert cache.length == kept
            assert_states_equal(cache.linear_states(), fresh_states(model, tokens))
        # and decoding goes on from the rolled-back state as from a fresh one
        following = random_ids(3, seed=8)
        fresh = model.new_cache(128)
        model(torch.tensor([tokens]), fresh)
        assert (model(following, cache) - model(following, fresh)).abs().max() <= LOGIT_TOL


def test_every_rollback_during_speculation_is_exact(saved, monkeypatch):
    """Target and draft caches, checked against a fresh run at every rollback the engine makes."""
    target, draft = saved["qwen3_5_moe"][2], saved["qwen3_next"][2]
    runs = {}  # id(cache) -> (the model's own forward, its own new_cache, tokens fed by position)
    checked = []

    def track(model) -> None:
        forward, make_cache = model.forward, model.new_cache

        def new_cache(max_len, batch=1):
            cache = make_cache(max_len, batch)
            runs[id(cache)] = (forward, make_cache, [])
            return cache

        def tracked_forward(tokens, cache, last_only=False):
            runs[id(cache)][2][cache.length:] = tokens[0].tolist()
            return forward(tokens, cache, last_only)

        monkeypatch.setattr(model, "new_cache", new_cache)
        monkeypatch.setattr(model, "forward", tracked_forward)

    rollback = HybridCache.rollback

    def checked_rollback(cache, length):
        shortened = length < cache.length
        rollback(cache, length)
        if shortened:
            forward, make_cache, tokens = runs[id(cache)]
            reference = make_cache(128)
            forward(torch.tensor([tokens[:length]]), reference)
            assert_states_equal(cache.linear_states(), reference.linear_states())
            checked.append(length)

    track(target.model)
    track(draft.model)
    monkeypatch.setattr(HybridCache, "rollback", checked_rollback)
    baseline = generate(target, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    result = generate(target, PROMPT, draft=draft, gamma=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert result.token_ids == baseline.token_ids
    assert len(checked) >= 10  # both caches rolled back in most rounds


def test_rollback_before_the_commit_point_is_refused(saved):
    model = saved["qwen3_5"][2].model
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(random_ids(10), cache)
        model(random_ids(4, seed=1), cache)
        cache.rollback(12)  # keeps two of the four: position 12 is the new commit point
        with pytest.raises(RollbackError, match="last commit point"):
            cache.rollback(11)
        with pytest.raises(RollbackError):
            cache.rollback(13)  # past the end
    assert cache.length == 12


def test_long_pass_can_be_left_only_at_its_ends(saved):
    model = saved["qwen3_5"][2].model
    ids = random_ids(20)
    cache = model.new_cache(64)
    cache.replay_window = 8  # passes longer than this keep no per-position record
    with torch.inference_mode():
        model(ids[:, :4], cache)
        cache.rollback(4)
        model(ids[:, 4:], cache)
        with pytest.raises(RollbackError, match="inside the last pass"):
            cache.rollback(10)
        cache.rollback(4)
        assert_states_equal(cache.linear_states(), fresh_states(model, ids[0, :4].tolist()))
        cache.rollback(0)
    assert_states_equal(cache.linear_states(), fresh_states(model, []))


def test_history_window_moves_without_losing_recent_positions(saved):
    """Many steps with no rollback (a draft whose every token is kept): the last window stays reachable."""
    model = saved["qwen3_5_moe"][2].model
    ids = random_ids(40)[0].tolist()
    cache = model.new_cache(64)
    cache.replay_window = 4
    with torch.inference_mode():
        for token in ids:
            model(torch.tensor([[token]]), cache)
        assert len(ids) - cache.base_length <= 2 * cache.replay_window
        cache.rollback(len(ids) - 4)
        assert_states_equal(cache.linear_states(), fresh_states(model, ids[:-4]))
        with pytest.raises(RollbackError):
            cache.rollback(10)


def test_state_bytes_count_every_delta_net_layer(saved):
    model = saved["qwen3_5_moe"][2].model
    channels = 2 * 2 * 16 + 4 * 16  # q, k (2 heads of 16) and v (4 heads of 16)
    per_layer = channels * (4 - 1) * 4 + 4 * 16 * 16 * 4  # float32 conv window + recurrent state
    assert model.state_bytes() == 3 * per_layer
    assert model.new_cache(8).state_bytes() == model.state_bytes()


# ------------------------------------------------------------------ speculation changes nothing

@pytest.fixture(scope="module")
def baselines(saved):
    return {family: generate(saved[family][2], PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids
            for family in FAMILIES}


def speculate(target, draft, gamma: int):
    """(result, origins of each round after the prefill)."""
    rounds = defaultdict(list)
    for event in stream(target, PROMPT, draft=draft, gamma=gamma, max_tokens=MAX_TOKENS, ignore_eos=True):
        if isinstance(event, Finished):
            return event.result, [rounds[r] for r in sorted(rounds) if r > 0]
        rounds[event.round].append(event.origin)
    raise AssertionError("no Finished event")


def assert_accounting(result) -> None:
    spec = result.spec
    assert len(result.token_ids) == spec.accepted + spec.recovered + spec.bonus + spec.plain
    assert result.origins.count("draft") == spec.accepted
    assert result.origins.count("recovered") == spec.recovered


@pytest.mark.parametrize("gamma", range(1, 17))
@pytest.mark.parametrize("draft_family", ["qwen3_5_moe", "qwen3_5", "qwen3_next"])
def test_speculation_on_a_hybrid_moe_target_changes_nothing(saved, baselines, draft_family, gamma):
    """Draft = target (every draft kept); a hybrid dense draft; an unrelated hybrid MoE draft."""
    target, draft = saved["qwen3_5_moe"][2], saved[draft_family][2]
    result, rounds = speculate(target, draft, gamma)
    assert result.token_ids == baselines["qwen3_5_moe"]
    assert_accounting(result)
    if draft_family == "qwen3_5_moe":
        assert result.spec.recovered == 0 and result.spec.acceptance_rate == 1.0
        assert any(origins == ["draft"] * gamma + ["bonus"] for origins in rounds)  # all kept
    else:
        assert ["recovered"] in rounds  # every draft of the round rejected


@pytest.mark.parametrize("gamma", [1, 4, 16])
@pytest.mark.parametrize("target_family, draft_family", [
    ("qwen3_5", "qwen3_5"), ("qwen3_5", "qwen3_next"), ("qwen3_next", "qwen3_next"), ("qwen3_next", "qwen3_5")])
def test_speculation_on_other_hybrid_targets_changes_nothing(saved, baselines, target_family, draft_family, gamma):
    result, rounds = speculate(saved[target_family][2], saved[draft_family][2], gamma)
    assert result.token_ids == baselines[target_family]
    assert_accounting(result)
    if target_family == draft_family:
        assert result.spec.recovered == 0
    else:
        assert ["recovered"] in rounds


# ------------------------------------------------------------------ GGUF, as llama.cpp's converter writes it

def _tile_value_heads(t: torch.Tensor, axis: int, key_heads: int, per_key: int, head_size: int) -> torch.Tensor:
    """llama.cpp's Qwen3.5 reorder: value heads grouped per key head -> tiled."""
    dims = list(t.shape)
    grouped = t.reshape(*dims[:axis], key_heads, per_key, head_size, *dims[axis + 1:])
    return grouped.transpose(axis, axis + 1).reshape(dims)


def llama_cpp_tensors(hf_model, arch: str) -> dict[str, torch.Tensor]:
    """The converter's tensors for a transformers hybrid model (convert_hf_to_gguf.py, Qwen3Next / Qwen3.5)."""
    cfg = hf_model.config
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    keys = 2 * hk * dk
    tile = arch != "qwen3next" and hk != hv
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "linear_attn.in_proj_qkv": "attn_qkv",
             "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
             "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_ba": "ssm_ba",
             "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
             "linear_attn.out_proj": "ssm_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp"}
    out: dict[str, torch.Tensor] = {}
    for name, value in hf_model.state_dict().items():
        value = value.detach().float().clone()
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            value = value + 1
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm",
                 "lm_head.weight": "output"}[name] + ".weight"] = value
            continue
        parts = name.split(".")
        layer, module = parts[2], ".".join(parts[3:-1])
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' in-memory layout: [E, 2I, H]
            gate, up = value.chunk(2, dim=1)
            out[f"blk.{layer}.ffn_gate_exps.weight"] = gate.contiguous()
            out[f"blk.{layer}.ffn_up_exps.weight"] = up.contiguous()
            continue
        if name.endswith("mlp.experts.down_proj"):
            out[f"blk.{layer}.ffn_down_exps.weight"] = value
            continue
        if module == "linear_attn" and parts[-1] in ("A_log", "dt_bias"):
            if tile:
                value = _tile_value_heads(value[:, None], 0, hk, r, 1)[:, 0]
            out[f"blk.{layer}." + ("ssm_a" if parts[-1] == "A_log" else "ssm_dt.bias")] = (
                -value.exp() if parts[-1] == "A_log" else value)
            continue
        if module == "linear_attn.in_proj_qkvz":  # [q k v z] per key head -> all q, all k, all v; and z
            grouped = value.T.reshape(-1, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=-1)
            flat = [t.reshape(value.shape[1], -1) for t in (q, k, v, z)]
            out[f"blk.{layer}.attn_qkv.weight"] = torch.cat(flat[:3], dim=-1).T.contiguous()
            out[f"blk.{layer}.attn_gate.weight"] = flat[3].T.contiguous()
            continue
        if module == "linear_attn.conv1d":
            value = value.squeeze(1)
        if tile and module in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
            value = torch.cat([value[:keys], _tile_value_heads(value[keys:], 0, hk, r, dv)])
        elif tile and module == "linear_attn.in_proj_z":
            value = _tile_value_heads(value, 0, hk, r, dv)
        elif tile and module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            value = _tile_value_heads(value, 0, hk, r, 1)
        elif tile and module == "linear_attn.out_proj":
            value = _tile_value_heads(value, 1, hk, r, dv)
        out[f"blk.{layer}.{block[module]}.{parts[-1]}"] = value
    return out


def write_hybrid_gguf(path: Path, hf_model, arch: str, tokenizer: bool = False) -> None:
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(getattr(cfg, "intermediate_size", 0) or 0)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
    if getattr(cfg, "num_experts", 0):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    if tokenizer:
        tiny.add_gguf_tokenizer(writer)
    for name, value in llama_cpp_tensors(hf_model, arch).items():
        writer.add_tensor(name, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family, arch", [("qwen3_5_moe", "qwen35moe"), ("qwen3_next", "qwen3next")])
def test_gguf_tensors_map_back_to_the_checkpoint(saved, tmp_path, monkeypatch, family, arch):
    """A file laid out as llama.cpp's converter writes it loads to the same logits as the folder."""
    import dataclasses

    from verispec.loading import gguf_file
    from verispec.models import build_model
    from verispec.models.qwen3_5 import gguf_config_fields, gguf_tensor_to_hf

    _, hf, ours = saved[family]
    path = tmp_path / "model.gguf"
    write_hybrid_gguf(path, hf, arch)
    reader = gguf_file.open_reader(path)
    meta = gguf_file.metadata(reader)
    monkeypatch.setitem(gguf_file.GGUF_ARCHITECTURES, arch, family)
    names = {t.name for t in reader.tensors}
    config = gguf_file.config_from_metadata(meta, names, tiny.VOCAB)
    config = dataclasses.replace(config, **gguf_config_fields(meta, arch))
    state = {}
    for tensor in reader.tensors:
        state.update(gguf_tensor_to_hf(tensor.name, gguf_file.dequantize(tensor), config))
    model = build_model(config)
    model.load_state_dict(model.sanitize(state), strict=True)
    ids = random_ids(12, seed=9)
    with torch.inference_mode():
        got = model(ids, model.new_cache(16))
        expected = ours.model(ids, ours.model.new_cache(16))
    assert (got - expected).abs().max() <= STATE_TOL


# ------------------------------------------------------------------ the lab

def test_synthetic_acceptance_sweep_on_a_hybrid_moe_target_audits_valid(saved, tmp_path, monkeypatch):
    """Every row of a sweep over synthetic acceptance rates passes the audit.

    Outputs and counts are the engine's own. Time is modelled: each target pass over
    m positions costs (1 + (m - 1) / 20) ms, so the physics rules judge what the engine
    did (one target pass per round, no token without one), not a shared machine's noise.
    """
    sweep = pytest.importorskip("verispec.lab.sweep")
    from types import SimpleNamespace

    import verispec.generate as engine
    from verispec.lab import audit
    from verispec.lab.records import read_records

    clock = [0.0]
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def advance(module, args) -> None:
        clock[0] += 1e-3 * (1 + (args[0].shape[1] - 1) / 20)

    load_for_bench = sweep.load_for_bench

    def timed_load(spec, weights=None, device="cpu"):
        loaded = load_for_bench(spec, weights, device)
        loaded.model.register_forward_pre_hook(advance)
        return loaded

    monkeypatch.setattr(sweep, "load_for_bench", timed_load)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a function that adds two numbers.\nTell me about cats.\n")
    config = sweep.sweep_config_from_dict({
        "targets": [str(saved["qwen3_5_moe"][0])], "proposers": ["synthetic:0", "synthetic:0.5", "synthetic:1"],
        "gammas": [2, 8], "prompts": [str(prompts)], "max_tokens": 16, "repeats": 1, "warmup": False,
        "out": str(tmp_path / "sweep.jsonl")})
    sweep.run_sweep(config)
    records = read_records(config.out)
    assert len(records) == 2 * (1 + 3 * 2)  # prompts x (baseline + proposers x gammas)
    assert [r["audit"]["status"] for r in records] == [audit.VALID] * len(records)
    by_rate = defaultdict(list)
    for r in records:
        if r["spec"]:
            by_rate[r["proposer"]].append(r["spec"]["acceptance_rate"])
    assert by_rate["synthetic:1"] == [1.0] * 4 and by_rate["synthetic:0"] == [0.0] * 4
    assert all(0 < rate < 1 for rate in by_rate["synthetic:0.5"])


def test_hybrid_gguf_file_loads_through_load_model(saved, tmp_path):
    """The whole loader: metadata, the hybrid tensor layout and the embedded tokenizer."""
    from verispec.loading import load_model

    _, hf, ours = saved["qwen3_5_moe"]
    path = tmp_path / "model.gguf"
    write_hybrid_gguf(path, hf, "qwen35moe", tokenizer=True)
    loaded = load_model(path)
    assert loaded.config.model_type == "qwen3_5_moe"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("hello")) == "hello"
    ids = random_ids(12, seed=9)
    with torch.inference_mode():
        got = loaded.model(ids, loaded.model.new_cache(16))
        expected = ours.model(ids, ours.model.new_cache(16))
    assert (got - expected).abs().max() <= STATE_TOL


def test_lab_counts_the_recurrent_state_in_bytes_per_pass(saved):
    from verispec.lab.bench import bytes_read_per_pass

    _, _, ours = saved["qwen3_5"]
    state = ours.model.state_bytes()
    assert state > 0
    assert bytes_read_per_pass(ours) == ours.weight_bytes() + state


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_a_verification_pass_gives_every_position_the_bits_of_a_step(tmp_path, family, fmt):
    """Delta-net mixing, gated attention and experts round a pass's rows as single steps do,
    and so does the replay of a pass's kept positions after a rollback."""
    assert kernels.cpu_kernels() is not None, "bit-identity rests on the CPU kernels (AVX2 or AVX-512)"
    save_hybrid(tmp_path, hybrid_config(family, shared_expert_intermediate_size=64), seed=4)
    model = load_model(tmp_path, weights=fmt).model
    ids = random_ids(14, seed=3)
    one_pass, steps = tiny.pass_and_steps(model, ids, prefix=5)
    assert torch.equal(one_pass, steps)
    with torch.inference_mode():  # keep 4 of a pass of 9, then step on: the bits of plain steps
        cache = model.new_cache(16)
        model(ids[:, :5], cache)
        model(ids[:, 5:], cache)
        cache.rollback(9)
        after_rollback = model(ids[:, 9:10], cache)
    assert torch.equal(after_rollback, steps[:, 4:5])


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_16_bit_kv_cache_leaves_the_states_alone_and_a_pass_bit_identical(tmp_path, fmt):
    """--kv-cache narrows only the gated attention's keys and values; the delta-net states
    keep their type, and a verification pass still gives each position the bits of a step."""
    save_hybrid(tmp_path, hybrid_config("qwen3_5"), seed=6)
    exact = load_model(tmp_path, weights=fmt).model
    model = load_model(tmp_path, weights=fmt, kv_cache="bfloat16").model
    cache, reference = model.new_cache(16), exact.new_cache(16)
    assert cache.kv.k.dtype == torch.bfloat16 and reference.kv.k.dtype == torch.float32
    assert [c.dtype for c in cache.conv] == [c.dtype for c in reference.conv]
    ids = random_ids(12, seed=8)
    one_pass, steps = tiny.pass_and_steps(model, ids, prefix=4)
    assert torch.equal(one_pass, steps)
    assert not torch.equal(steps, tiny.pass_and_steps(exact, ids, prefix=4)[1])  # the rounding is there


def test_the_stepwise_delta_rule_covers_every_verification_pass():
    from verispec.generate import MAX_GAMMA
    from verispec.models.common import VERIFY_PASS_MAX

    assert VERIFY_PASS_MAX == MAX_GAMMA + 1


def test_a_hybrid_draft_limited_to_the_first_ids_proposes_the_contexts_too(saved):
    """A hybrid draft with a draft vocabulary: its pass appends the context's ids' logits
    (extra_rows) after the first ids', and speculation still gives the target's output."""
    folder, _, target = saved["qwen3_5"]
    draft = load_model(folder)
    baseline = generate(target, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    limit = sorted(baseline.token_ids)[len(baseline.token_ids) // 2] + 1
    result = generate(target, PROMPT, draft=draft, gamma=4, max_tokens=MAX_TOKENS, ignore_eos=True, draft_vocab=limit)
    assert result.token_ids == baseline.token_ids
    drafted = [(t, result.token_ids[:i]) for i, (t, kind) in enumerate(zip(result.token_ids, result.origins))
               if kind == "draft"]
    above = [(t, before) for t, before in drafted if t >= limit]
    assert above and all(t in PROMPT or t in before for t, before in above)
