"""What attention costs in a decoding step as the context grows (the 1.5B target's shapes).

    python benchmarks/attention.py                 # contexts 128 .. 8192, m = 1 and 5
    python benchmarks/attention.py --contexts 512 --rows 1
    python benchmarks/attention.py --caches float32 bfloat16    # what a 16-bit cache would save

Attention is the part of a step that grows with the context: every new position reads
every cached key and value of its layer. This times the kernels' `attention` (rotary,
cache write and attention in one call) for Qwen2.5-Coder-1.5B's shapes (12 query heads,
2 key/value heads, head_dim 128, 28 layers) after `context` cached positions, for m new
positions (m = 1: a plain step; m = 5: a verification pass at γ = 4), on the usual threads.
The calls go round 28 caches, one per layer as in a real step, so a long context's keys
and values come from memory, not from the cache of the last call. Each row gives the time
per call, the 28 layers' time per step, and that as a share of a plain step's weight
reading at the read bandwidth measured in the same run (int8 weights: 1.55 GB per step), so
a share is a ratio within one run. The cache is float32, as decoding keeps it; --caches
times the kernel's 16-bit caches too, each after the other at every size, with its speed
against the first type's.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, read_bandwidth, save, warn_if_busy

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 12, 2, 128, 28
INT8_STEP_BYTES = 1.547e9  # the 1.5B in int8 (decode_bandwidth.py prints the same)


CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def time_attention(kernels, context: int, m: int, calls: int, rounds: int = 5, cache: str = "float32") -> float:
    """Median seconds of one attention call for m new positions after `context` cached ones,
    keys and values cached in `cache`."""
    generator = torch.Generator().manual_seed(0)
    max_len = context + m
    dtype = CACHES[cache]
    layers = [(torch.randn(KV_HEADS, max_len, HEAD_DIM, generator=generator).to(dtype),
               torch.randn(KV_HEADS, max_len, HEAD_DIM, generator=generator).to(dtype)) for _ in range(LAYERS)]
    qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
    angles = torch.rand(m, HEAD_DIM, generator=generator)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    times = []
    for round_index in range(rounds + 1):
        started = time.perf_counter()
        for call in range(calls):
            k, v = layers[call % LAYERS]
            kernels.attention(qkv, k, v, cos, sin, context, HEADS, KV_HEADS, 0, None, None, 1e-6)
        if round_index:  # the first round warms up
            times.append((time.perf_counter() - started) / calls)
    return median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    parser.add_argument("--caches", nargs="+", default=["float32"], choices=list(CACHES),
                        help="cache the keys and values in these types, each timed in turn (default: float32, "
                             "what decoding uses)")
    args = parser.parse_args()
    from verispec.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels are not available on this machine")
        return 1
    print(f"attention, 1.5B shapes: {torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    bandwidth = read_bandwidth(0.25 if args.quick else 0.5, repeats=2 if args.quick else 3)
    step = INT8_STEP_BYTES / bandwidth
    print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s: an int8 step reads its weights in {step * 1e3:.1f} ms")
    rows = []
    for m in args.rows:
        for context in args.contexts:
            calls = LAYERS * max(1, int((2e6 if args.quick else 2e7) / (LAYERS * context * (m + 1) * HEADS * HEAD_DIM)))
            first = None
            for cache in args.caches:
                seconds = time_attention(kernels, context, m, calls, rounds=2 if args.quick else 5, cache=cache)
                per_step = LAYERS * seconds
                first = first or seconds
                rows.append({"m": m, "context": context, "cache": cache, "call_s": seconds, "step_s": per_step,
                             "share_of_int8_step": per_step / step})
                against = f", {first / seconds:.2f}x the {args.caches[0]} cache's speed" if cache != args.caches[0] else ""
                label = f" ({cache} cache)" if len(args.caches) > 1 else ""
                print(f"  m = {m}, context {context:>5}{label}: {seconds * 1e6:8.1f} µs per call, {per_step * 1e3:7.2f} "
                      f"ms per step ({per_step / step:.1%} of an int8 step's weight reading{against})")
    name = "attention" + ("_quick" if args.quick else "") + ("" if args.caches == ["float32"] else "_caches")
    save(name, {"read_bandwidth": bandwidth, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
