"""Where a decoding step's products lose read bandwidth: by product, in the order a step runs them.

    python benchmarks/product_starts.py              # 12 rounds, int8, the 1.5B's shapes
    python benchmarks/product_starts.py --rounds 30

Builds 28 layers of Qwen2.5-1.5B's four int8 products (qkv 2048x1536, o 1536x1536,
gate_up 17920x1536, down 1536x8960; random weights in the panel layout) in one buffer in
the order a step reads them, as loading does, plus one product of 240 MB. Each round times,
with one row, taking turns:

  layer order    the products as a step runs them (qkv, o, gate_up, down, next layer ...),
                 each one timed; a product starts cold after a different one
  back to back   the 28 products of one kind in a row
  one product    the 240 MB product (10,240 panels of 24 KB): one start per stream
  loads only     the same back to back and one product read with no arithmetic
                 (kernels.read_int8_panels: the same regions, streams and pieces), so that
                 what the layout and the threads cost stands apart from what the products'
                 arithmetic costs

Each round sits between two read-bandwidth measurements; a way's utilisation is bytes of
weights over the higher of the two. Medians over the rounds whose measurements agree within
10%, apart for the host's fast and slow spells (as `stream_layout.py` splits them). Every call
goes through Python, about 2 us each, which the small products feel most.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, panel_kernels, read_bandwidth, save, warn_if_busy
from stream_layout import spells

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}  # (n, k)
LAYERS = 28
LONG_PANELS = 10240  # one product of 10,240 panels x 16 columns x 1536 inputs: 240 MB


def int8_panels(flat: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return flat.view(n // 16, k // 4, 16, 4)


def build(layers: int):
    """Every layer's products as views of one buffer, in run order, with their inputs and scales."""
    total = layers * sum(n * k for n, k in SHAPES.values())
    flat = torch.randint(-127, 128, (total,), dtype=torch.int8)
    products = {name: [] for name in SHAPES}
    offset = 0
    for _ in range(layers):
        for name, (n, k) in SHAPES.items():
            products[name].append(int8_panels(flat[offset:offset + n * k], n, k))
            offset += n * k
    inputs = {name: torch.randn(1, k) for name, (n, k) in SHAPES.items()}
    scales = {name: torch.rand(n) for name, (n, k) in SHAPES.items()}
    return flat, products, inputs, scales


def measure(rounds: int, layers: int, kernels) -> list[dict]:
    flat, products, inputs, scales = build(layers)
    long_product = int8_panels(torch.randint(-127, 128, (LONG_PANELS * 16 * 1536,), dtype=torch.int8), LONG_PANELS * 16, 1536)
    long_scale, long_input = torch.rand(LONG_PANELS * 16), torch.randn(1, 1536)
    size = {name: products[name][0].numel() * layers for name in SHAPES}

    def layer_order() -> dict[str, float]:
        spent = dict.fromkeys(SHAPES, 0.0)
        for layer in range(layers):
            for name in SHAPES:
                started = time.perf_counter()
                kernels.linear_int8_panels(inputs[name], products[name][layer], scales[name], None, None)
                spent[name] += time.perf_counter() - started
        return spent

    def multiply(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor) -> None:
        kernels.linear_int8_panels(x, panels, scale, None, None)

    def read_only(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor) -> None:
        kernels.read_int8_panels(panels)

    def back_to_back(name: str, way=multiply) -> float:
        started = time.perf_counter()
        for layer in range(layers):
            way(inputs[name], products[name][layer], scales[name])
        return time.perf_counter() - started

    def one_product(way=multiply) -> float:
        started = time.perf_counter()
        way(long_input, long_product, long_scale)
        return time.perf_counter() - started

    layer_order(), one_product()  # first use: caches and page tables
    records = []
    for _ in range(rounds):
        before = read_bandwidth(0.5, repeats=2, keep=True)
        times: dict[str, list[float]] = {}
        for _ in range(3):
            for name, spent in layer_order().items():
                times.setdefault(f"{name}, layer order", []).append(spent)
            for name in SHAPES:
                times.setdefault(f"{name}, back to back", []).append(back_to_back(name))
                times.setdefault(f"{name}, loads only", []).append(back_to_back(name, read_only))
            times.setdefault("one product", []).append(one_product())
            times.setdefault("one product, loads only", []).append(one_product(read_only))
        after = read_bandwidth(0.5, repeats=2, keep=True)
        best = max(before, after)
        nbytes = {way: long_product.numel() if way.startswith("one product") else size[way.split(",")[0]]
                  for way in times}
        records.append({"bandwidth_before": before, "bandwidth_after": after,
                        "utilisation": {way: nbytes[way] / median(t) / best for way, t in times.items()}})
    del flat
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()

    kernels = panel_kernels()
    if kernels is None:
        return 1
    print(f"product starts: int8, {args.layers} layers of the 1.5B's shapes, {torch.get_num_threads()} threads, "
          f"{machine_load()}")
    warn_if_busy()
    records = measure(args.rounds, args.layers, kernels)
    summary = spells(records)
    for name, spell in summary.items():
        low, high = spell["bandwidth"]
        print(f"  {name} spell ({spell['rounds']} steady rounds, {low / 1e9:.0f}-{high / 1e9:.0f} GB/s):")
        for way, share in spell["utilisation"].items():
            print(f"    {way:24s} {share:.0%}")
    save("product_starts", {"layers": args.layers, "rounds": records, "spells": summary}, history={"spells": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
