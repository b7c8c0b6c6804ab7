"""Target 8: the engine on a GPU, with random-weight models of real shapes built on the device.

    python benchmarks/gpu_bench.py                      # CUDA: an 8B dense and a 30B-A3B MoE shape, bf16
    python benchmarks/gpu_bench.py --tiny --device cpu  # the same script at toy sizes (the tests run this)

For each model: the device's read bandwidth, a decoding step's bandwidth utilisation (bytes
of weights the step reads / step time / bandwidth; for the MoE only the experts the step
routed to count), the verification cost r(m) = t(m)/t(1) for m = 1..32, and the speed-up of
speculative decoding under synthetic acceptance α in {0, 0.5, 0.8} x γ in {4, 8, 16}: a
proposer that drafts the target's own next token with probability α and costs nothing,
so the figure is what the target's verification passes allow. Every speculative output is
audited against plain decoding. Timings synchronise the device before reading the clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

HERE = Path(__file__).resolve().parent

SHAPES = {
    # Qwen3-8B's shape
    "dense-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     qk_norm=True, max_position_embeddings=4096),
    # Qwen3-30B-A3B's shape: 128 experts, 8 per token
    "moe-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                        qk_norm=True, max_position_embeddings=4096),
}
TINY = {
    "dense-8b": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "moe-30b-a3b": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32),
}
ALPHAS = (0.0, 0.5, 0.8)
GAMMAS = (4, 8, 16)


class _Tokenizer:
    """Random models speak no language: token ids in, no text out."""

    eos_ids: set[int] = set()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    buffer = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    buffer.sum()
    best = min(timed(device, buffer.sum) for _ in range(5))
    del buffer
    return nbytes / best


def build(name: str, device: torch.device, dtype: torch.dtype, tiny: bool, seed: int = 0):
    from verispec.config import ModelConfig
    from verispec.loading import LoadedModel
    from verispec.models import build_model

    config = ModelConfig(**{**SHAPES[name], **(TINY[name] if tiny else {})})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never materialise the float32 model
    try:
        with torch.device(device):
            model = build_model(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    loaded = LoadedModel(name, Path(name), model, _Tokenizer(), config, 0.0, dtype, device, str(dtype))
    return loaded


def bytes_per_step(model) -> int:
    """Weights one single-token step reads: all but the embedding table; for an MoE only the
    experts the step routed to (read after the step has run)."""
    from verispec.quant import weight_bytes

    total = weight_bytes(model)
    if hasattr(model, "moe_blocks"):
        total -= sum(b.experts.bytes_per_expert() * b.num_experts for b in model.moe_blocks())
        total += model.touched_expert_bytes()
    return total


@torch.inference_mode()
def verify_costs(model, device, context: int, sizes, rounds: int) -> tuple[dict[int, float], int]:
    cache = model.new_cache(context + max(sizes) + 1)
    vocab = model.config.vocab_size
    model(torch.arange(context, device=device).view(1, -1) % vocab, cache)
    feed = (torch.arange(max(sizes), device=device).view(1, -1) * 7 + 3) % vocab
    times: dict[int, list[float]] = {m: [] for m in sizes}
    step_bytes = 0
    for round_index in range(rounds + 1):
        for m in sizes:
            cache.rollback(context)
            elapsed = timed(device, lambda: model(feed[:, :m], cache))
            if m == 1:
                step_bytes = max(step_bytes, bytes_per_step(model))
            if round_index:
                times[m].append(elapsed)
    medians = {m: statistics.median(t) for m, t in times.items()}
    return medians, step_bytes


def speculative_grid(loaded, device, prompt_len: int, tokens: int) -> dict:
    from verispec.generate import generate
    from verispec.spec.synthetic import SyntheticProposer

    vocab = loaded.config.vocab_size
    prompt = [(i * 31 + 5) % vocab for i in range(prompt_len)]
    plain_runs = [generate(loaded, prompt, max_tokens=tokens) for _ in range(2)]
    reference = plain_runs[-1].token_ids
    plain_s = min(r.timings.decode_s for r in plain_runs)
    grid = {}
    for alpha in ALPHAS:
        for gamma in GAMMAS:
            proposer = SyntheticProposer(reference, alpha, vocab, seed=1)
            spec = generate(loaded, prompt, draft=proposer, gamma=gamma, max_tokens=tokens)
            grid[f"a={alpha},g={gamma}"] = {
                "alpha": alpha, "gamma": gamma, "speedup": plain_s / spec.timings.decode_s,
                "acceptance": spec.spec.acceptance_rate, "valid": spec.token_ids == reference}
    return {"plain_tok_s": (len(reference) - 1) / plain_s, "grid": grid}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="toy sizes (for a CPU check of the script)")
    parser.add_argument("--max-m", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokens = args.tokens or (12 if args.tiny else 128)
    sizes = list(range(1, args.max_m + 1))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = read_bandwidth(device, (64 << 20) if args.tiny else (4 << 30))
    print(f"device {name}: read bandwidth {bandwidth / 1e9:.0f} GB/s; {args.dtype}{', toy sizes' if args.tiny else ''}")
    results = {"device": name, "dtype": args.dtype, "tiny": args.tiny, "read_bandwidth": bandwidth, "models": {}}
    for model_name in args.models:
        loaded = build(model_name, device, dtype, args.tiny)
        costs, step_bytes = verify_costs(loaded.model, device, 128 if not args.tiny else 16, sizes,
                                         rounds=2 if args.tiny else 5)
        t1 = costs[1]
        utilisation = step_bytes / t1 / bandwidth
        grid = speculative_grid(loaded, device, 16 if args.tiny else 64, tokens)
        results["models"][model_name] = {"step_s": t1, "step_bytes": step_bytes, "utilisation": utilisation,
                                         "r": {m: costs[m] / t1 for m in sizes}, **grid}
        print(f"\n{model_name}: step {t1 * 1e3:.2f} ms reading {step_bytes / 1e9:.2f} GB "
              f"-> {step_bytes / t1 / 1e9:.0f} GB/s = {utilisation:.0%} of read bandwidth; "
              f"plain {grid['plain_tok_s']:.1f} tok/s")
        print("  r(m): " + " ".join(f"{m}:{costs[m] / t1:.2f}" for m in sizes))
        print("  speed-up under synthetic acceptance (rows α, columns γ = " + ", ".join(map(str, GAMMAS)) + "):")
        for alpha in ALPHAS:
            cells = [grid["grid"][f"a={alpha},g={g}"] for g in GAMMAS]
            print(f"    α={alpha:.1f}: " + "  ".join(
                f"{c['speedup']:.2f}x{'' if c['valid'] else ' INVALID'}" for c in cells))
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out) if args.out else HERE / "results" / "gpu" / f"gpu_bench{'_tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    valid = all(c["valid"] for m in results["models"].values() for c in m["grid"].values())
    return 0 if valid else 1


if __name__ == "__main__":
    sys.exit(main())
