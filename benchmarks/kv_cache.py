"""What a 16-bit KV cache (`--kv-cache bfloat16` or `float16`) gives: step time over long
contexts, the cache's memory, and how often greedy tokens stay the same.

    python benchmarks/kv_cache.py            # the 1.5B in int8: contexts 512, 2048, 8192; 10 prompts x 64 tokens
    python benchmarks/kv_cache.py --quick    # contexts 512 and 2048, 3 prompts x 16 tokens

Speed: one model, one cache of each type filled to `context` positions with random keys
and values (what attention costs does not depend on them), and a plain step (m = 1) and a
verification pass over 5 positions (γ = 4) at that context, each rolled back so that every
timing sees the same context. The cache types take turns round by round, each round between
two read-bandwidth measurements (perf_common.take_turns), and each type's time is given as
the median of its per-round ratio to float32's: a ratio within one run.

Agreement: the same weights decode 10 Spec-Bench prompts x 64 tokens greedily over each
cache type; against the float32 cache, as agreement.py does for weight formats: the same
next token under teacher forcing, and the outputs identical as a whole. (Speculative output
over a 16-bit cache equals plain output over the same cache by construction; the tests
check that.)
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from agreement import common_prefix, next_token_agreement
from perf_common import machine_load, median, save, take_turns, verdict, warn_if_busy

CACHE_TYPES = ("float32", "bfloat16", "float16")


def filled_cache(model, dtype: torch.dtype, context: int, extra: int):
    """A cache of `dtype` holding `context` positions of random keys and values."""
    model.cache_dtype = dtype
    cache = model.new_cache(context + extra)
    generator = torch.Generator().manual_seed(context)
    for store in (cache.k, cache.v):
        store[:, :, :, :context] = torch.randn(store[:, :, :, :context].shape, generator=generator).to(dtype)
    cache.advance(context)
    return cache


def step_timer(model, cache, context: int, m: int, repeats: int):
    tokens = torch.arange(100, 100 + m).view(1, m)

    @torch.inference_mode()
    def timed() -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            model(tokens, cache, last_only=True)
            cache.rollback(context)
        return (time.perf_counter() - started) / repeats
    return timed


def speed(model, weight_bytes: int, contexts: list[int], rounds: int) -> list[dict]:
    rows = []
    for context in contexts:
        for m in (1, 5):
            caches = {name: filled_cache(model, getattr(torch, name), context, m) for name in CACHE_TYPES}
            timers = {name: step_timer(model, cache, context, m, repeats=3) for name, cache in caches.items()}
            for timer in timers.values():
                timer()  # warm-up
            records = take_turns(timers, rounds, weight_bytes)
            seconds = {name: median([r["seconds"][name] for r in records]) for name in CACHE_TYPES}
            ratios = {name: median([r["seconds"]["float32"] / r["seconds"][name] for r in records])
                      for name in CACHE_TYPES[1:]}
            per_position = {name: cache.nbytes() // cache.max_len for name, cache in caches.items()}
            rows.append({"context": context, "m": m, "seconds": seconds, "speed_vs_float32": ratios,
                         "cache_bytes_per_position": per_position, "rounds": records})
            gb_s = [r["bandwidth_before"] / 1e9 for r in records]
            print(verdict(f"{'plain step' if m == 1 else 'verification pass of 5'} at {context:,} positions",
                          f"float32 cache {seconds['float32'] * 1e3:.1f} ms; " + "; ".join(
                              f"{name} {seconds[name] * 1e3:.1f} ms ({ratios[name]:.2f}x as fast)"
                              for name in CACHE_TYPES[1:]) + f" (read bandwidth {min(gb_s):.0f}–{max(gb_s):.0f} GB/s)",
                          None))
            del caches, timers
    model.cache_dtype = None
    return rows


def agreement(loaded, count: int, tokens: int) -> dict:
    from verispec.generate import encode_prompt, generate
    from verispec.lab.prompts import load_prompts

    model, cases, results = loaded.model, [], {}
    model.cache_dtype = None
    for prompt in load_prompts("spec-bench", limit=count):
        ids = encode_prompt(loaded.tokenizer, prompt.text, chat=True)
        cases.append((ids, generate(loaded, ids, max_tokens=tokens, ignore_eos=True).token_ids))
    total = sum(len(ref) for _, ref in cases)
    for name in CACHE_TYPES[1:]:
        model.cache_dtype = getattr(torch, name)
        agree = sum(next_token_agreement(model, ids, ref) for ids, ref in cases)
        outputs = [generate(loaded, ids, max_tokens=tokens, ignore_eos=True).token_ids for ids, _ in cases]
        identical = sum(out == ref for out, (_, ref) in zip(outputs, cases))
        prefix = sum(common_prefix(out, ref) for out, (_, ref) in zip(outputs, cases)) / len(cases)
        results[name] = {"next_token": agree / total, "identical": identical, "prefix": prefix}
        print(verdict(f"agreement of a {name} cache with a float32 cache",
                      f"same next token {agree}/{total} = {agree / total:.1%}; identical outputs "
                      f"{identical}/{len(cases)}, mean identical prefix {prefix:.1f} tokens", None))
    model.cache_dtype = None
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="rounds per context and pass size")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    contexts = args.contexts or ([512, 2048] if args.quick else [512, 2048, 8192])
    rounds = args.rounds or (5 if args.quick else 15)
    count, tokens = args.prompts or (3 if args.quick else 10), args.tokens or (16 if args.quick else 64)

    from verispec.loading import load_model

    loaded = load_model(args.model, weights=args.weights)
    print(f"KV cache types: {loaded.name} ({args.weights}), {torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    rows = speed(loaded.model, loaded.weight_bytes(), contexts, rounds)
    agreed = agreement(loaded, count, tokens)
    save("kv_cache" + ("_quick" if args.quick else ""),
         {"model": args.model, "weights": args.weights, "speed": rows, "agreement": agreed,
          "prompts": count, "tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
