"""Mixture-of-experts families against transformers: logits, routing, the cache, GGUF, speculation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import tiny
from verispec import kernels
from verispec.config import ModelConfig
from verispec.errors import CorruptModelError
from verispec.generate import generate
from verispec.loading import load_model
from verispec.models import build_model
from verispec.models.moe import MoeCausalLM, SparseMoeBlock

IDS = torch.tensor([[5, 77, 100, 3, 9, 200, 42, 17]])
TOP_K = 2
NUM_EXPERTS = 8

CASES = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe-norm-sparse-step": ("qwen2_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                                 "num_hidden_layers": 3}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-mlp-only-layer": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 4}),
}


def moe_config(family: str, **overrides):
    """A tiny transformers config: 8 experts, top-2, hidden 64."""
    import transformers

    common = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=tiny.EOS_ID, bos_token_id=None, tie_word_embeddings=False,
                  num_experts_per_tok=TOP_K)
    if family == "qwen2_moe":
        cls = transformers.Qwen2MoeConfig
        common.update(num_experts=NUM_EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    elif family == "qwen3_moe":
        cls = transformers.Qwen3MoeConfig
        common.update(num_experts=NUM_EXPERTS, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True)
    else:
        cls = transformers.MixtralConfig
        common.update(num_local_experts=NUM_EXPERTS, intermediate_size=32)
    common.update(overrides)
    return cls(**common)


def save_moe_model(folder: Path, family: str, seed: int = 0, **overrides):
    """Build, randomise and save a tiny transformers MoE model; returns the transformers model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, **overrides))
    tiny.randomize(model, seed)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    tiny.write_tokenizer(folder)
    return model


def reference_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids).logits.float()


def stepwise_logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(64)
    with torch.no_grad():
        rows = [model(ids[:, i:i + 1], cache)[0, -1] for i in range(ids.shape[1])]
    return torch.stack(rows).unsqueeze(0)


def sparse_layers(ref) -> list[int]:
    """Indices of the transformers layers that route to experts."""
    return [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved model per case, shared by the tests of this module: case -> (folder, transformers model)."""
    made = {}

    def get(case: str):
        if case not in made:
            family, overrides = CASES[case]
            folder = tmp_path_factory.mktemp(case)
            made[case] = folder, save_moe_model(folder, family, **overrides)
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_matches_transformers(saved, case):
    folder, ref = saved(case)
    loaded = load_model(folder)
    model = loaded.model
    assert loaded.config.num_experts == NUM_EXPERTS
    assert len(model.moe_blocks()) == len(sparse_layers(ref))
    expected = reference_logits(ref, IDS)
    with torch.no_grad():
        prefill = model(IDS, model.new_cache(64))
    assert (prefill - expected).abs().max() <= 1e-4
    assert (stepwise_logits(model, IDS) - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_rollback_then_decode_equals_fresh_run(saved, case):
    model = load_model(saved(case)[0]).model
    other = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad():
        cache = model.new_cache(64)
        model(IDS, cache)
        cache.rollback(3)
        after = model(other, cache)
        fresh = model(torch.cat([IDS[:, :3], other], dim=1), model.new_cache(64))[:, 3:]
    assert (after - fresh).abs().max() <= 1e-5


def router_choices(ref, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The experts transformers' routers picked: sparse layer index -> [tokens, top_k]."""
    chosen, hooks = {}, []
    for i in sparse_layers(ref):
        def keep(module, args, output, i=i):
            chosen[i] = output[2]  # (router logits, weights, expert indices)
        hooks.append(ref.model.layers[i].mlp.gate.register_forward_hook(keep))
    try:
        reference_logits(ref, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return chosen


def distinct_experts(chosen: dict[int, torch.Tensor], positions: slice) -> list[int]:
    return [len(set(chosen[i][positions].flatten().tolist())) for i in sorted(chosen)]


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_moe-mlp-only-layer", "mixtral"])
def test_experts_touched_follow_the_router(saved, case):
    folder, ref = saved(case)
    model = load_model(folder).model
    chosen = router_choices(ref, IDS)
    assert model.experts_touched() == [0] * len(chosen)  # nothing has run yet
    cache = model.new_cache(64)
    with torch.no_grad():
        model(IDS[:, :5], cache)  # a prefill of 5 tokens
        assert model.experts_touched() == distinct_experts(chosen, slice(0, 5))
        model(IDS[:, 5:6], cache)  # one decoding step
        assert model.experts_touched() == [TOP_K] * len(chosen)
        assert model.experts_touched() == distinct_experts(chosen, slice(5, 6))
        model(IDS[:, 6:8], cache)  # a verify pass over 2 positions
        assert model.experts_touched() == distinct_experts(chosen, slice(6, 8))
    one_expert = model.moe_blocks()[0].experts.bytes_per_expert()
    assert model.touched_expert_bytes() == sum(distinct_experts(chosen, slice(6, 8))) * one_expert


def test_block_runs_only_chosen_experts():
    """An expert no token picked is never run: poisoning its weights changes nothing."""
    config = ModelConfig(
        model_type="qwen3_moe", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4)
    block = SparseMoeBlock(config)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        expected = block(x)
        _, experts = block.route(x.reshape(-1, 8))
        unused = sorted(set(range(4)) - set(experts.flatten().tolist()))
        assert unused and block.experts_touched == 4 - len(unused)
        block.experts.gate_proj[unused] = float("nan")
        assert torch.equal(block(x), expected)


def test_sanitize_reads_the_fused_layout_of_transformers(saved):
    """transformers keeps experts fused in memory (gate_up_proj [E, 2ff, hidden]); those load too."""
    folder, ref = saved("qwen2_moe")
    model = build_model(load_model(folder).config)
    model.load_state_dict(model.sanitize(dict(ref.state_dict())), strict=True)
    model.eval()
    with torch.no_grad():
        got = model(IDS, model.new_cache(64))
    assert (got - reference_logits(ref, IDS)).abs().max() <= 1e-4


def test_a_missing_expert_is_a_clear_error(saved):
    folder, ref = saved("mixtral")
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    with pytest.raises(CorruptModelError, match=r"layers\.1\.mlp\.experts\.down_proj.*\[3\]"):
        MoeCausalLM.sanitize(state)


# ------------------------------------------------------------------ GGUF

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def llama_row_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the 'llama' architecture (which Mixtral files use)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(ref, arch: str):
    """(GGUF name, array) for every weight, from our stacked layout of the saved checkpoint."""
    cfg = ref.config
    state = MoeCausalLM.sanitize({k: v.detach().float() for k, v in ref.state_dict().items()})
    for name, tensor in state.items():
        array = tensor.numpy()
        if name in _TOP_NAMES:
            yield _TOP_NAMES[name], array
            continue
        parts = name.split(".")  # model.layers.N.<module...>[.weight|.bias]
        kind = parts[-1] if parts[-1] in ("weight", "bias") else "weight"
        module = ".".join(parts[3:-1] if parts[-1] in ("weight", "bias") else parts[3:])
        if module == "self_attn.q_proj" and arch == "llama":
            array = llama_row_order(array, cfg.num_attention_heads)
        elif module == "self_attn.k_proj" and arch == "llama":
            array = llama_row_order(array, cfg.num_key_value_heads)
        elif module == "mlp.shared_expert_gate":
            array = array.reshape(-1)  # llama.cpp declares this gate as a vector
        yield f"blk.{parts[2]}.{_GGUF_NAMES[module]}.{kind}", array


def write_moe_gguf(path: Path, ref, arch: str) -> None:
    """Write a transformers MoE model as an F32 GGUF file with the tiny tokenizer embedded."""
    import gguf

    cfg = ref.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(cfg.num_local_experts if arch != "qwen2moe" else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "llama":  # llama.cpp's Mixtral files carry no expert width: the FFN is the expert
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    vocab = tiny.byte_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in tiny.SPECIALS else 1 for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in tiny.MERGES])
    writer.add_eos_token_id(tiny.EOS_ID)
    writer.add_add_bos_token(False)
    for name, array in gguf_tensors(ref, arch):
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case,arch", [("qwen2_moe", "qwen2moe"), ("qwen3_moe-mlp-only-layer", "qwen3moe"),
                                       ("mixtral", "llama")])
def test_gguf_matches_transformers(saved, tmp_path, case, arch):
    folder, ref = saved(case)
    path = tmp_path / "model.gguf"
    write_moe_gguf(path, ref, arch)
    loaded = load_model(path)
    from_folder = load_model(folder).config
    for field in ("model_type", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers"):
        assert getattr(loaded.config, field) == getattr(from_folder, field), field
    assert len(loaded.model.moe_blocks()) == len(sparse_layers(ref))
    expected = reference_logits(ref, IDS)
    with torch.no_grad():
        assert (loaded.model(IDS, loaded.model.new_cache(64)) - expected).abs().max() <= 1e-4
    assert (stepwise_logits(loaded.model, IDS) - expected).abs().max() <= 1e-4


# ------------------------------------------------------------------ speculation

@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral"])
def test_greedy_speculation_with_itself_as_draft_equals_plain_decoding(saved, case):
    target = load_model(saved(case)[0])
    prompt = IDS[0].tolist()
    plain = generate(target, prompt, max_tokens=24, ignore_eos=True)
    assert len(plain.token_ids) == 24
    for gamma in range(1, 9):
        spec = generate(target, prompt, draft=target, gamma=gamma, max_tokens=24, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, f"gamma={gamma}"
        assert spec.spec.accepted == spec.spec.drafted  # a draft identical to the target is always right


def test_greedy_speculation_with_an_unrelated_draft_equals_plain_decoding(saved, tmp_path):
    target = load_model(saved("qwen3_moe")[0])
    save_moe_model(tmp_path, "qwen3_moe", seed=1)
    draft = load_model(tmp_path)
    prompt = IDS[0].tolist()
    plain = generate(target, prompt, max_tokens=24, ignore_eos=True)
    for gamma in (1, 4, 8):
        spec = generate(target, prompt, draft=draft, gamma=gamma, max_tokens=24, ignore_eos=True)
        assert spec.token_ids == plain.token_ids, f"gamma={gamma}"


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_a_verification_pass_gives_every_position_the_bits_of_a_step(tmp_path, family, fmt):
    """Greedy speculative output equals plain output by construction, not by luck at near-ties:
    attention, experts and shared experts round a pass's rows as single steps do. (Sizes are
    multiples of 32, as in real checkpoints: the kernels take those.)"""
    assert kernels.cpu_kernels() is not None, "bit-identity rests on the CPU kernels (AVX2 or AVX-512)"
    save_moe_model(tmp_path, family, seed=5, **({"shared_expert_intermediate_size": 64}
                                                 if family == "qwen2_moe" else {}))
    model = load_model(tmp_path, weights=fmt).model
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 66, 12, 3, 200, 8]])
    one_pass, steps = tiny.pass_and_steps(model, ids, prefix=4)
    assert torch.equal(one_pass, steps)


EXPERT_STORAGE = {"float32": ("float", torch.float32), "bfloat16": ("float", torch.bfloat16),
                  "int8": ("int8", torch.int8), "int4": ("int4", torch.uint8)}


@pytest.mark.parametrize("fmt", list(EXPERT_STORAGE))
def test_the_experts_take_the_weight_format_too(saved, fmt):
    """The routed experts are most of an MoE's weights: --weights applies to them as to every
    other product, and what they compute stays close to the float32 experts."""
    folder, _ = saved("qwen3_moe")
    reference = load_model(folder, weights="float32").model
    model = load_model(folder, weights=fmt).model
    experts = model.moe_blocks()[0].experts
    kind, dtype = EXPERT_STORAGE[fmt]
    assert experts.kind == kind and experts.gate_proj.dtype == dtype
    # gate and up [32, 64], down [64, 32]: 6,144 weights; int8 adds a float32 scale per row,
    # int4 a float16 scale and offset per row and group of 32 inputs
    assert experts.bytes_per_expert() == {"float32": 4 * 6144, "bfloat16": 2 * 6144, "int8": 6144 + 4 * 128,
                                          "int4": 6144 // 2 + 4 * (2 * 32 * 2 + 64 * 1)}[fmt]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    tolerance = {"float32": 0, "bfloat16": 0.02, "int8": 0.03, "int4": 0.2}[fmt]  # of the largest output
    with torch.inference_mode():
        for expert in range(NUM_EXPERTS):
            expected = reference.moe_blocks()[0].experts(x, expert)
            got = experts(x, expert)
            assert (got - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_packed_experts_give_the_same_function_without_the_kernels(saved, fmt):
    """PyTorch's path (no kernels, or a GPU) dequantises the expert it runs: float32 rounding only."""
    folder, _ = saved("mixtral")
    experts = load_model(folder, weights=fmt).model.moe_blocks()[0].experts
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for expert in range(NUM_EXPERTS):
            fast = experts(x, expert)
            with kernels.switched_off():
                plain = experts(x, expert)
            assert (plain - fast).abs().max() <= 1e-5 * fast.abs().max()


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_weight_cache_keeps_the_experts_format(saved, tmp_path, monkeypatch, fmt):
    from verispec.loading import weight_cache

    monkeypatch.setattr(weight_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    _, ref = saved("qwen2_moe")
    write_moe_gguf(tmp_path / "model.gguf", ref, "qwen2moe")
    first = load_model(tmp_path / "model.gguf", weights=fmt)
    second = load_model(tmp_path / "model.gguf", weights=fmt)
    assert second.info.get("gguf_metadata_keys", 0) == 0  # came from the cache, not the file
    assert second.model.moe_blocks()[0].experts.kind == first.model.moe_blocks()[0].experts.kind
    assert all(torch.equal(t, second.model.state_dict()[n]) for n, t in first.model.state_dict().items())
    assert (generate(first, "the cat", max_tokens=10, ignore_eos=True).token_ids
            == generate(second, "the cat", max_tokens=10, ignore_eos=True).token_ids)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral-sliding-window", "qwen2_moe"])
def test_attention_runs_on_the_kernel_with_the_function_of_pytorchs(saved, case, monkeypatch):
    """Norms, rotary, cache write and attention in one kernel call (one read of the cache for
    a whole verification pass), computing what PyTorch's path computes."""
    assert kernels.cpu_kernels() is not None, "the attention kernel needs AVX2 or AVX-512"
    from verispec.models.common import Attention

    folder, _ = saved(case)
    model = load_model(folder, weights="float32").model
    calls = []
    kernel_forward = Attention._kernel_forward
    monkeypatch.setattr(Attention, "_kernel_forward", lambda self, *a: calls.append(1) or kernel_forward(self, *a))
    with torch.inference_mode():
        fast = model(IDS, model.new_cache(16))
        assert len(calls) == model.config.num_hidden_layers
        with kernels.switched_off():
            plain = model(IDS, model.new_cache(16))
    assert len(calls) == model.config.num_hidden_layers  # not on PyTorch's path
    assert (plain - fast).abs().max() <= 1e-4 * plain.abs().max()


@pytest.mark.parametrize("fmt,stored", [("int8", torch.int8), ("int4", torch.uint8), ("bfloat16", torch.bfloat16)])
def test_gguf_experts_are_packed_as_they_are_decoded(saved, tmp_path, fmt, stored):
    """Loading never holds every expert in float32 (most of an MoE's weights): each stack is
    packed as it is decoded, and the model gives the same tokens as packing after loading."""
    from verispec.loading.gguf_file import load_gguf

    _, ref = saved("qwen3_moe")
    write_moe_gguf(tmp_path / "model.gguf", ref, "qwen3moe")
    _, state, _, _ = load_gguf(tmp_path / "model.gguf", torch.float32, expert_format=fmt)
    stacks = {n: t for n, t in state.items() if ".mlp.experts." in n and t.dim() == 3}
    assert stacks and all(t.dtype == stored for t in stacks.values())
    loaded = load_model(tmp_path / "model.gguf", weights=fmt)
    after = load_model(saved("qwen3_moe")[0], weights=fmt)  # the folder: packed after loading
    assert (generate(loaded, "the cat", max_tokens=10, ignore_eos=True).token_ids
            == generate(after, "the cat", max_tokens=10, ignore_eos=True).token_ids)
