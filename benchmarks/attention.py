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

    python benchmarks/attention.py --patch benchmarks/variants/some_change.patch
    python benchmarks/attention.py --variant /path/to/changed_cpu_kernels.cpp

With --patch or --variant, a changed kernel source (built as `stack_ab.py` builds it) is
timed against the current one instead: at every size the ways take turns round by round,
each over the same caches, so the ratios are within one run; each way's output is first
checked to equal the current kernels' bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, read_bandwidth, rotated, save, warn_if_busy

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 12, 2, 128, 28
INT8_STEP_BYTES = 1.547e9  # the 1.5B in int8 (decode_bandwidth.py prints the same)


CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Inputs:
    """28 layers' caches of `context` positions (random keys and values in `cache`'s type) and
    m new positions' q/k/v, as one step's attention calls see them."""

    def __init__(self, context: int, m: int, cache: str = "float32"):
        generator = torch.Generator().manual_seed(0)
        dtype = CACHES[cache]
        self.context = context
        self.layers = [(torch.randn(KV_HEADS, context + m, HEAD_DIM, generator=generator).to(dtype),
                        torch.randn(KV_HEADS, context + m, HEAD_DIM, generator=generator).to(dtype))
                       for _ in range(LAYERS)]
        self.qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=generator)
        angles = torch.rand(m, HEAD_DIM, generator=generator)
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()

    def call(self, kernels, layer: int) -> torch.Tensor:
        k, v = self.layers[layer % LAYERS]
        return kernels.attention(self.qkv, k, v, self.cos, self.sin, self.context, HEADS, KV_HEADS, 0, None, None, 1e-6)

    def seconds_per_call(self, kernels, calls: int) -> float:
        started = time.perf_counter()
        for call in range(calls):
            self.call(kernels, call)
        return (time.perf_counter() - started) / calls


def time_attention(kernels, context: int, m: int, calls: int, rounds: int = 5, cache: str = "float32") -> float:
    """Median seconds of one attention call for m new positions after `context` cached ones,
    keys and values cached in `cache`."""
    inputs = Inputs(context, m, cache)
    inputs.seconds_per_call(kernels, calls)  # warms up
    return median([inputs.seconds_per_call(kernels, calls) for _ in range(rounds)])


def compare_ways(ways: dict, context: int, m: int, calls: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each way (name -> kernel module) at one size, the ways
    taking turns round by round over the same caches."""
    inputs = Inputs(context, m)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(rounds + 1):
        for name in rotated(list(ways), round_index):
            seconds = inputs.seconds_per_call(ways[name], calls)
            if round_index:  # the first round warms up
                times[name].append(seconds)
    return {name: median(t) for name, t in times.items()}


def main_compare(args, current) -> int:
    """--patch / --variant: each changed kernel source against the current one, size by size."""
    from stack_ab import ChangedKernels

    changed = ChangedKernels(args.variant, args.patch)
    ways = {"current": current, **changed.modules}
    print(f"attention, 1.5B shapes, {len(ways) - 1} changed kernel(s) against the current: "
          f"{torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    rows = []
    for m in args.rows:
        for context in args.contexts:
            inputs = Inputs(context, m)
            reference = inputs.call(current, 0)
            for name, kernels in ways.items():
                if not args.no_check and not torch.equal(inputs.call(kernels, 0), reference):
                    print(f"{name}: its output differs from the current kernels' at m = {m}, context {context} "
                          "(use --no-check if that is intended)")
                    return 1
            calls = LAYERS * max(1, int((2e6 if args.quick else 2e7) / (LAYERS * context * (m + 1) * HEADS * HEAD_DIM)))
            seconds = compare_ways(ways, context, m, calls, rounds=3 if args.quick else 9)
            rows.append({"m": m, "context": context, "call_s": seconds})
            cells = [f"{name} {s * 1e6:.1f} µs" + ("" if name == "current" else f" ({seconds['current'] / s:.2f}x)")
                     for name, s in seconds.items()]
            print(f"  m = {m}, context {context:>5}: " + ", ".join(cells))
    save(args.save_as, {"ways": list(ways), "variants": changed.recorded, "rows": rows})
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    parser.add_argument("--caches", nargs="+", default=["float32"], choices=list(CACHES),
                        help="cache the keys and values in these types, each timed in turn (default: float32, "
                             "what decoding uses)")
    parser.add_argument("--variant", type=Path, action="append", default=[],
                        help="time a changed cpu_kernels.cpp against the current one")
    parser.add_argument("--patch", type=Path, action="append", default=[],
                        help="time the current cpu_kernels.cpp with this patch applied against it")
    parser.add_argument("--no-check", action="store_true", help="with --patch/--variant: do not require equal outputs")
    parser.add_argument("--save-as", default="attention_ab", help="with --patch/--variant: results/perf/<host>/<name>.json")
    args = parser.parse_args()
    from verispec.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        print("the CPU kernels are not available on this machine")
        return 1
    if args.variant or args.patch:
        return main_compare(args, kernels)
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
