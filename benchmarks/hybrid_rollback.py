"""What exact rollback of a hybrid model's recurrent state costs, against the passes around it.

A random model with Qwen3.5-0.8B's layer shapes (hidden 1024; delta-net layers with 16
key and 16 value heads of 128; gated attention with 8 heads of 256; SwiGLU of 3584),
fewer layers (3 delta-net + 1 attention by default). For each γ, in one run:

    step      one single-position pass
    verify    one pass over γ+1 positions (what the target runs per round)
    rollback  HybridCache.rollback to keep half of those positions: the conv windows
              are rebuilt and the recurrent states replayed over the kept positions

and prints each as a ratio to the single step (medians of --repeats). The memory
columns are what the cache holds for rollback: the base state (a second copy of the
state) and the per-position records.

    .venv/bin/python benchmarks/hybrid_rollback.py
    .venv/bin/python benchmarks/hybrid_rollback.py --layers 8 --gammas 1 4 8 16 --repeats 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from verispec.config import ModelConfig
from verispec.models import build_model

CONTEXT = 256


def qwen3_5_like(layers: int) -> ModelConfig:
    kinds = ["linear_attention"] * (layers - 1) + ["full_attention"]
    return ModelConfig(
        model_type="qwen3_5_text", vocab_size=1024, hidden_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584,
        partial_rotary_factor=0.25, rope_theta=1e7, max_position_embeddings=4096,
        extra={"layer_types": kinds, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4})


def random_model(config: ModelConfig) -> torch.nn.Module:
    model = build_model(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if "norm" in name else 0.02))
    return model.eval()


def timed(prepare, run, repeats: int) -> float:
    """Median seconds of run(prepare()) over repeats; prepare is not timed."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        subject = prepare()
        started = time.perf_counter()
        run(subject)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def record_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.records for r in layer
               for t in (r.conv_inputs, r.keys, r.values, r.decay, r.beta))


@torch.inference_mode()
def measure(model, gamma: int, repeats: int) -> dict:
    prompt = torch.randint(0, model.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(1))
    committed = model.new_cache(CONTEXT + 64)
    model(prompt, committed)
    committed.rollback(CONTEXT)  # the commit point every measurement starts from
    one, many = prompt[:, :1], prompt[:, :gamma + 1]
    kept = CONTEXT + (gamma + 2) // 2

    def fresh():
        return copy.deepcopy(committed)

    def verified():
        cache = fresh()
        model(many, cache)
        return cache

    t_step = timed(fresh, lambda cache: model(one, cache), repeats)
    t_verify = timed(fresh, lambda cache: model(many, cache), repeats)
    t_rollback = timed(verified, lambda cache: cache.rollback(kept), repeats)
    return {"gamma": gamma, "step_ms": 1e3 * t_step, "verify_r": t_verify / t_step, "kept": kept - CONTEXT,
            "rollback_r": t_rollback / t_step, "state_mib": committed.state_bytes() / 2**20,
            "records_kib": record_bytes(verified()) / 2**10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = random_model(qwen3_5_like(args.layers))
    print(f"{args.layers} layers ({args.layers - 1} delta-net), context {CONTEXT}, "
          f"{torch.get_num_threads()} threads; times as ratios to one single-position step")
    print(f"{'γ':>3} {'step ms':>8} {'verify/step':>12} {'kept':>5} {'rollback/step':>14} "
          f"{'state MiB':>10} {'records KiB':>12}")
    for gamma in args.gammas:
        row = measure(model, gamma, args.repeats)
        print(f"{row['gamma']:>3} {row['step_ms']:>8.2f} {row['verify_r']:>12.2f} {row['kept']:>5} "
              f"{row['rollback_r']:>14.3f} {row['state_mib']:>10.2f} {row['records_kib']:>12.1f}")


if __name__ == "__main__":
    main()
