"""How far ahead a one-row product should fetch its two streams per thread (`set_pair_prefetch`).

    python benchmarks/pair_prefetch.py                         # the 1.5B in every format, 0 to 2 KB
    python benchmarks/pair_prefetch.py --formats int4 --distances 0 1024 1536 --rounds 12

A plain decoding step reads each thread's region of a product's panels as two streams side
by side. How well the hardware prefetcher alone keeps them fed depends on the processor: on
an AMD EPYC (Zen 4) fetching them in software read less, on an Intel Xeon the hardware alone
left every format well short of the read bandwidth. For each weight format the model runs
one-row forward passes (no sampling) with each distance in turn, step by step within each
round, each round between two read-bandwidth measurements (perf_common.take_turns), and
every distance's logits are first checked to be bit-identical to the others' (prefetching
moves no arithmetic). Utilisation is bytes of weights per step over the higher of the two
measurements; the figures are medians over the rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, median, panel_kernels, processor, save, take_turns, verdict, warn_if_busy

PROMPT = "def merge(a, b):\n    return sorted(a + b)\n"


def step_timer(model, cache, start: int, steps: int, kernels, distance: int, logits: dict):
    token = torch.tensor([[100]])

    @torch.inference_mode()
    def timed() -> float:
        default = kernels.pair_prefetch()
        kernels.set_pair_prefetch(distance)
        try:
            times = []
            for _ in range(steps + 1):  # the first step warms up
                cache.rollback(start)
                started = time.perf_counter()
                logits[distance] = model(token, cache, last_only=True)
                times.append(time.perf_counter() - started)
        finally:
            kernels.set_pair_prefetch(default)
        return median(times[1:])
    return timed


def measure(fmt: str, model_name: str, distances: list[int], rounds: int, steps: int, kernels) -> dict:
    from verispec.loading import load_model

    loaded = load_model(model_name, weights=fmt)
    model = loaded.model
    ids = loaded.tokenizer.encode(PROMPT)
    cache = model.new_cache(len(ids) + 2)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache)
    logits: dict[int, torch.Tensor] = {}
    timers = {d: step_timer(model, cache, cache.length, steps, kernels, d, logits) for d in distances}
    for timer in timers.values():
        timer()
    first = logits[distances[0]]
    if not all(torch.equal(first, logits[d]) for d in distances):
        raise SystemExit(f"{fmt}: the logits differ between prefetch distances")
    records = take_turns(timers, rounds, loaded.weight_bytes())
    seconds = {d: median([r["seconds"][d] for r in records]) for d in distances}
    utilisation = {d: median([r["utilisation"][d] for r in records]) for d in distances}
    levels = [r["bandwidth_before"] / 1e9 for r in records]
    default = kernels.pair_prefetch()
    print(f"  {fmt:>8}: " + "; ".join(f"{d} B {seconds[d] * 1e3:.1f} ms ({utilisation[d]:.0%})" for d in distances)
          + f" (read bandwidth {min(levels):.1f}-{max(levels):.1f} GB/s)")
    best = min(distances, key=lambda d: seconds[d])
    if default in seconds:
        print(verdict(f"{fmt}: the default distance ({default} B) against the fastest ({best} B)",
                      f"{seconds[best] / seconds[default]:.3f}x the default's step time", None))
    free(loaded, model, cache)
    return {"seconds": {str(d): s for d, s in seconds.items()},
            "utilisation": {str(d): u for d, u in utilisation.items()}, "rounds": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", nargs="+", default=["int4", "int8", "bfloat16", "float32"])
    parser.add_argument("--distances", type=int, nargs="+", default=[0, 512, 1024, 1536, 2048])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per distance and round (their median counts)")
    args = parser.parse_args()
    kernels = panel_kernels()
    if kernels is None:
        return 1
    print(f"pair prefetch: {args.model}, {torch.get_num_threads()} threads, {processor()['name']}, "
          f"default {kernels.pair_prefetch()} B, {machine_load()}")
    warn_if_busy()
    results = {fmt: measure(fmt, args.model, args.distances, args.rounds, args.steps, kernels) for fmt in args.formats}
    save("pair_prefetch", {"model": args.model, "default": kernels.pair_prefetch(), "formats": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
