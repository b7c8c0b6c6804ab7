"""The two int4 products side by side on the 1.5B target's layer shapes: the float32 path
(`linear_int4`: dequantise by table lookup, float32 FMAs) and the integer panel path
(`linear_int4_panels`: activations rounded to int8 per group of 32, `vpdpbusd` with AVX-512
VNNI, `vpmaddubsw` with AVX2).

    python benchmarks/int4_kernels.py              # m = 1, 5, 9 on all threads
    python benchmarks/int4_kernels.py --layers 8 --rows 1 2 5 9 17
    python benchmarks/int4_kernels.py --model qwen2.5-coder-1.5b   # whole forward passes

One "layer" is Qwen2.5-1.5B's four products (qkv 2048x1536, o 1536x1536, gate_up
17920x1536, down 1536x8960: 46.8 M weights, 29 MB); several distinct copies are cycled so
that the weights come from memory, not the 32 MB L3. The paths and row counts are
interleaved round by round, so a change in machine load hits them alike; medians are given.

With --model, the same comparison on a real model loaded in int4: forward passes over m
positions after a prompt (as decode_bandwidth.py times them), with the lean forward bound
once to each kernel and the two swapped round by round.
"""

from __future__ import annotations

import argparse
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6, help="distinct copies of the layer (default 6, 175 MB)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="time whole forward passes of this model in int4")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        return real_model(args.model, args.rows, args.rounds)

    from verispec.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not hasattr(kernels, "linear_int4_panels"):
        print("the CPU kernels are not built on this machine (they need AVX2 or AVX-512, and a compiler)")
        return 1
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layer = []
        for n, k in SHAPES:
            nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
            scales = (torch.rand(n, k // 32, 2, generator=generator) * 0.02 - 0.01).to(torch.float16)
            layer.append((nibbles, scales, kernels.int4_to_panels(nibbles, scales)))
        layers.append(layer)
    weights = sum(n * k for n, k in SHAPES)
    inputs = {m: {k: torch.randn(m, k, generator=generator) for k in {k for _, k in SHAPES}} for m in args.rows}

    def run(path: str, m: int) -> float:
        started = time.perf_counter()
        for layer in layers:
            for (nibbles, scales, panels), (n, k) in zip(layer, SHAPES):
                x = inputs[m][k]
                if path == "float":
                    kernels.linear_int4(x, nibbles, scales, None, None)
                else:
                    kernels.linear_int4_panels(x, panels, None, None)
        return (time.perf_counter() - started) / len(layers)

    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in ("float", "panels") for m in args.rows}
    for round_index in range(args.rounds + 1):
        for m in args.rows:
            for path in ("float", "panels"):
                t = run(path, m)
                if round_index:
                    times[path, m].append(t)
    median = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    print(f"int4 products, one 1.5B layer ({weights / 1e6:.1f} M weights), {torch.get_num_threads()} threads, "
          f"{args.layers} copies, median of {args.rounds}")
    print(f"{'m':>3} {'float ms':>9} {'panel ms':>8} {'speed-up':>8} {'float Gw/s':>10} {'panel Gw/s':>9} "
          f"{'panel GB/s':>9} {'r float':>7} {'r panel':>7}")
    for m in args.rows:
        f, v = median["float", m], median["panels", m]
        print(f"{m:>3} {f * 1e3:>9.2f} {v * 1e3:>8.2f} {f / v:>8.2f} {weights / f / 1e9:>10.1f} "
              f"{weights / v / 1e9:>9.1f} {weights * 0.625 / v / 1e9:>9.1f} "
              f"{f / median['float', args.rows[0]]:>7.2f} {v / median['panels', args.rows[0]]:>7.2f}")
    return 0


@torch.inference_mode()
def real_model(name: str, sizes: list[int], rounds: int) -> int:
    from verispec import quant
    from verispec.loading import load_model

    from verispec import kernels

    kernels.set_enabled(False)  # loading would lay the layers out in panels at once
    try:
        loaded = load_model(name, weights="int4")
    finally:
        kernels.set_enabled(True)
    model, fast = loaded.model, loaded.model.fast_path
    prompt = loaded.tokenizer.encode("def merge(a, b):\n    # merge two sorted lists into one sorted list\n")
    cache = model.new_cache(len(prompt) + max(sizes) + 1)
    feed = torch.tensor([prompt])
    bound = {}
    switch = quant.Int4Linear._use_panels
    quant.Int4Linear._use_panels = lambda self, kernels: None  # first bind the float32 int4 kernel
    try:
        model(feed, cache)
    finally:
        quant.Int4Linear._use_panels = switch
    bound["float"] = fast.stack, fast.heads  # the bound products keep the canonical tensors alive
    fast.stack, fast.heads = None, {}
    quant.panels_in_one_buffer(model, kernels.cpu_kernels())  # as loading lays them out
    cache.rollback(0)
    model(feed, cache)  # binds again, to the panels
    bound["panels"] = fast.stack, fast.heads
    length = cache.length
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in bound for m in sizes}
    for round_index in range(rounds + 1):
        for m in sizes:
            for path, (stack, heads) in bound.items():
                fast.stack, fast.heads = stack, heads
                cache.rollback(length)
                started = time.perf_counter()
                model(feed[:, :m], cache)
                if round_index:
                    times[path, m].append(time.perf_counter() - started)
    median = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    step_bytes = loaded.weight_bytes()
    print(f"{name} int4, {step_bytes / 1e6:.0f} MB of weights per step, {torch.get_num_threads()} threads, "
          f"median of {rounds} forward passes over m positions")
    print(f"{'m':>3} {'float ms':>9} {'panel ms':>8} {'speed-up':>8} {'r float':>7} {'r panel':>7} {'panel GB/s':>9}")
    for m in sizes:
        f, v = median["float", m], median["panels", m]
        print(f"{m:>3} {f * 1e3:>9.1f} {v * 1e3:>8.1f} {f / v:>8.2f} {f / median['float', sizes[0]]:>7.2f} "
              f"{v / median['panels', sizes[0]]:>7.2f} {step_bytes / v / 1e9:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
