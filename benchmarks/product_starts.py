"""Where a decoding step's products lose read bandwidth: by product, in the order a step runs them.

    python benchmarks/product_starts.py              # 12 rounds, int8, the 1.5B's shapes
    python benchmarks/product_starts.py --rounds 30
    python benchmarks/product_starts.py --weights int4
    python benchmarks/product_starts.py --weights int4 --model 0.5b   # the draft's shapes

Builds 28 layers of Qwen2.5-1.5B's four products (qkv 2048x1536, o 1536x1536,
gate_up 17920x1536, down 1536x8960; random int8 or int4 weights in the panel layout) in one
buffer in the order a step reads them, as loading does, plus one product of 240 MB (int4:
150 MB). --model 0.5b builds the draft's 24 layers instead (qkv 1152x896, o 896x896, gate_up
9728x896, down 896x4864). Each round times, with one row, taking turns:

  layer order    the products as a step runs them (qkv, o, gate_up, down, next layer ...),
                 each one timed; a product starts cold after a different one
  back to back   the 28 products of one kind in a row
  one product    the 240 MB product (10,240 panels of 24 KB): one start per stream
  loads only     the same back to back and one product read with no arithmetic
                 (kernels.read_int8_panels: the same regions, streams and pieces; int4's
                 panels read as int8 panels of the same bytes, 10 KB per 1,024 inputs), so
                 that what the layout and the threads cost stands apart from what the
                 products' arithmetic costs; int4 products of 896 inputs (28 groups of 320
                 B) are not whole groups of int8 inputs, so the 0.5B's int4 qkv, o and
                 gate_up have no loads-only way

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
MODELS = {"1.5b": (LAYERS, SHAPES),
          "0.5b": (24, {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)})}
LONG_PANELS = 10240  # one product of 10,240 panels x 16 columns x 1536 inputs: 240 MB


INT4_GROUP_BYTES = 320  # per panel and group of 32 inputs: 16 scales and 16 offsets (float16), 256 B of nibbles


def panel_bytes(weights: str, n: int, k: int) -> int:
    return n * k if weights == "int8" else n // 16 * k // 32 * INT4_GROUP_BYTES


def as_panels(flat: torch.Tensor, weights: str, n: int, k: int) -> torch.Tensor:
    """A product's bytes as the kernel takes them: int8 [n/16, k/4, 16, 4], int4 uint8 [n/16, k/32, 320]."""
    if weights == "int8":
        return flat.view(n // 16, k // 4, 16, 4)
    return flat.view(torch.uint8).view(n // 16, k // 32, INT4_GROUP_BYTES)


def as_int8_panels(panels: torch.Tensor) -> torch.Tensor:
    """The same bytes as int8 panels of 16 columns, for read_int8_panels: one int4 panel's
    320 bytes per group of 32 inputs are 20 inputs of 16 int8 columns."""
    if panels.dtype == torch.int8:
        return panels
    return panels.view(torch.int8).view(panels.shape[0], -1, 16, 4)


def reads_as_int8_panels(panels: torch.Tensor) -> bool:
    """Whether as_int8_panels gives read_int8_panels whole groups of 32 inputs."""
    return as_int8_panels(panels).shape[1] * 4 % 32 == 0


def random_panels(total: int, weights: str) -> torch.Tensor:
    """Random weights; int4's scales and offsets float16 1.0 and 0.0 (random halves could be
    infinities or NaNs)."""
    flat = torch.randint(-127, 128, (total,), dtype=torch.int8)
    if weights == "int4":
        groups = flat.view(torch.uint8).view(-1, INT4_GROUP_BYTES)
        groups[:, :32].view(torch.float16).fill_(1.0)
        groups[:, 32:64].zero_()
    return flat


def build(layers: int, weights: str = "int8", shapes: dict[str, tuple[int, int]] = SHAPES):
    """Every layer's products as views of one buffer, in run order, with their inputs and scales."""
    flat = random_panels(layers * sum(panel_bytes(weights, n, k) for n, k in shapes.values()), weights)
    products = {name: [] for name in shapes}
    offset = 0
    for _ in range(layers):
        for name, (n, k) in shapes.items():
            size = panel_bytes(weights, n, k)
            products[name].append(as_panels(flat[offset:offset + size], weights, n, k))
            offset += size
    inputs = {name: torch.randn(1, k) for name, (n, k) in shapes.items()}
    scales = {name: torch.rand(n) for name, (n, k) in shapes.items()}
    return flat, products, inputs, scales


def measure(rounds: int, layers: int, kernels, weights: str = "int8",
            shapes: dict[str, tuple[int, int]] = SHAPES) -> list[dict]:
    flat, products, inputs, scales = build(layers, weights, shapes)
    n_long = LONG_PANELS * 16
    long_product = as_panels(random_panels(panel_bytes(weights, n_long, 1536), weights), weights, n_long, 1536)
    long_scale, long_input = torch.rand(n_long), torch.randn(1, 1536)
    size = {name: products[name][0].numel() * layers for name in shapes}
    read_alone = [name for name in shapes if reads_as_int8_panels(products[name][0])]

    def multiply(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor) -> None:
        if weights == "int8":
            kernels.linear_int8_panels(x, panels, scale, None, None)
        else:  # int4's scales are in its panels
            kernels.linear_int4_panels(x, panels, None, None)

    def layer_order() -> dict[str, float]:
        spent = dict.fromkeys(shapes, 0.0)
        for layer in range(layers):
            for name in shapes:
                started = time.perf_counter()
                multiply(inputs[name], products[name][layer], scales[name])
                spent[name] += time.perf_counter() - started
        return spent

    def read_only(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor) -> None:
        kernels.read_int8_panels(as_int8_panels(panels))

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
            for name in shapes:
                times.setdefault(f"{name}, back to back", []).append(back_to_back(name))
                if name in read_alone:
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
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--weights", choices=["int8", "int4"], default="int8")
    parser.add_argument("--model", choices=list(MODELS), default="1.5b", help="whose products' shapes")
    args = parser.parse_args()

    kernels = panel_kernels()
    if kernels is None:
        return 1
    model_layers, shapes = MODELS[args.model]
    layers = args.layers or model_layers
    print(f"product starts: {args.weights}, {layers} layers of the {args.model.upper()}'s shapes, "
          f"{torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    records = measure(args.rounds, layers, kernels, args.weights, shapes)
    summary = spells(records)
    for name, spell in summary.items():
        low, high = spell["bandwidth"]
        print(f"  {name} spell ({spell['rounds']} steady rounds, {low / 1e9:.0f}-{high / 1e9:.0f} GB/s):")
        for way, share in spell["utilisation"].items():
            print(f"    {way:24s} {share:.0%}")
    name = "product_starts" + ("" if args.weights == "int8" else f"_{args.weights}")
    name += "" if args.model == "1.5b" else f"_{args.model}"
    save(name, {"weights": args.weights, "model": args.model, "layers": layers, "rounds": records,
                "spells": summary}, history={"spells": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
