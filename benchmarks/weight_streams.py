"""How fast the weight kernels read memory, per layout and page size, against plain sums.

    python benchmarks/weight_streams.py                  # float32, bfloat16, int8, int4; m = 1 and 5
    python benchmarks/weight_streams.py --formats int8 --rows 1 --rounds 15
    python benchmarks/weight_streams.py --threads 1     # what one core reads
    python benchmarks/weight_streams.py --prefetch 0 8192 20480 40960   # prefetch distances, bytes
    python benchmarks/weight_streams.py --streams 1 2   # one stream per thread, or two side by side

For each format, six copies of one Qwen2.5-1.5B layer's four products (qkv 2048x1536,
o 1536x1536, gate_up 17920x1536, down 1536x8960; far more than the 32 MB cache) are
multiplied by m rows, in three ways:

  row-major     the canonical weights with the row-major kernels (`linear_float`, `linear_int8`)
  panels        the panel layout (`linear_float_panels`, `linear_int8_panels`) on 2 MB pages
  panels-4k     the same panels copied into memory that is kept on 4 KB pages

and three plain sums read a buffer of the same size (`stream_sum`: without and with fetching
ahead, and as two streams per thread). With --prefetch, the panels run once per prefetch
distance instead (0: the hardware prefetcher alone); with --streams, once per number of
streams each thread reads side by side (`set_panel_streams`, one-row products). int4's
row-major kernel is the float32 one (`linear_int4`). Everything is interleaved round by
round in one process, so a change in machine load hits all alike; medians are given as
GB/s of weights read.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait and asks for huge pages)
import torch

from perf_common import machine_load, median, panel_kernels, save, warn_if_busy

SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))
MADV_NOHUGEPAGE = 15


def small_pages_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into anonymous memory that the kernel is told not to back with huge pages."""
    nbytes = tensor.numel() * tensor.element_size()
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, nbytes, MADV_NOHUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_NOHUGEPAGE) failed")
    copy = torch.frombuffer(area, dtype=torch.uint8, count=nbytes).view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    copy.area = area  # keeps the mapping alive as long as the tensor
    return copy


def build(fmt: str, copies: int, kernels) -> tuple[dict, int]:
    """The three ways to run each product: name -> list of (function of x, input size)."""
    from verispec.quant import Int4Linear, Int8Linear, to_panels

    generator = torch.Generator().manual_seed(0)
    ways: dict[str, list] = {"row-major": [], "panels": [], "panels-4k": []}
    nbytes = 0
    for _ in range(copies):
        for n, k in SHAPES:
            weight = torch.randn(n, k, generator=generator)
            if fmt == "int4":
                layer = Int4Linear.from_float(weight)
                q, scales = layer.nibbles, layer.scales
                panels = kernels.int4_to_panels(q, scales)
                small = small_pages_copy(panels)
                ways["row-major"].append((lambda x, q=q, s=scales: kernels.linear_int4(x, q, s, None, None), k))
                ways["panels"].append((lambda x, p=panels: kernels.linear_int4_panels(x, p, None, None), k))
                ways["panels-4k"].append((lambda x, p=small: kernels.linear_int4_panels(x, p, None, None), k))
                nbytes += panels.numel()
                continue
            if fmt == "int8":
                layer = Int8Linear.from_float(weight)
                w, scale = layer.weight, layer.scale
                panels = to_panels(w)
                small = small_pages_copy(panels)
                ways["row-major"].append((lambda x, w=w, s=scale: kernels.linear_int8(x, w, s, None, None), k))
                ways["panels"].append((lambda x, p=panels, s=scale: kernels.linear_int8_panels(x, p, s, None, None), k))
                ways["panels-4k"].append((lambda x, p=small, s=scale: kernels.linear_int8_panels(x, p, s, None, None), k))
            else:
                w = weight.to(getattr(torch, fmt))
                panels = to_panels(w)
                small = small_pages_copy(panels)
                ways["row-major"].append((lambda x, w=w: kernels.linear_float(x, w, None, None), k))
                ways["panels"].append((lambda x, p=panels: kernels.linear_float_panels(x, p, None, None), k))
                ways["panels-4k"].append((lambda x, p=small: kernels.linear_float_panels(x, p, None, None), k))
            nbytes += w.numel() * w.element_size()
    return ways, nbytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefetch", type=int, nargs="+", default=None,
                        help="run the panels at each of these prefetch distances (bytes, multiples of 64)")
    parser.add_argument("--streams", type=int, nargs="+", default=None, choices=[1, 2],
                        help="run the panels with each of these numbers of streams per thread")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    kernels = panel_kernels()
    if kernels is None:
        return 1
    print(f"weight streams: {torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    results = {}
    default = {"prefetch": kernels.stream_prefetch(), "streams": kernels.panel_streams()}

    def use(setting: dict) -> None:
        kernels.set_stream_prefetch(setting["prefetch"])
        kernels.set_panel_streams(setting["streams"])

    for fmt in args.formats:
        ways, nbytes = build(fmt, args.copies, kernels)
        settings = {name: default for name in ways}
        if args.prefetch or args.streams:
            panels = ways.pop("panels")
            del ways["panels-4k"]
            for distance in args.prefetch or []:
                name = f"panels@{distance // 1024}K" if distance else "panels@none"
                ways[name], settings[name] = panels, {**default, "prefetch": distance}
            for streams in args.streams or []:
                name = f"panels x{streams}"
                ways[name], settings[name] = panels, {**default, "streams": streams}
        buffer = torch.ones(nbytes // 4)
        sums = {"sum": lambda b=buffer: kernels.stream_sum(b), "sum-prefetch": lambda b=buffer: kernels.stream_sum(b, True),
                "sum x2": lambda b=buffer: kernels.stream_sum(b, False, 2)}
        for m in args.rows:
            inputs = {k: torch.randn(m, k) for k in {k for _, k in SHAPES}}
            times: dict[str, list[float]] = {name: [] for name in [*ways, *sums]}
            for round_index in range(args.rounds + 1):
                for name, products in ways.items():
                    use(settings[name])
                    started = time.perf_counter()
                    for product, k in products:
                        product(inputs[k])
                    if round_index:  # the first round warms up
                        times[name].append(time.perf_counter() - started)
                use(default)
                for name, read in sums.items():
                    started = time.perf_counter()
                    read()
                    if round_index:
                        times[name].append(time.perf_counter() - started)
            rate = {name: nbytes / median(t) / 1e9 for name, t in times.items()}
            results[f"{fmt} m={m}"] = rate
            line = f"  {fmt:>8} m={m}: " + ", ".join(f"{name} {r:.1f}" for name, r in rate.items()) + " GB/s"
            if "panels" in rate:
                line += (f"; panels / row-major {rate['panels'] / rate['row-major']:.2f}, "
                         f"2 MB / 4 KB pages {rate['panels'] / rate['panels-4k']:.2f}, "
                         f"panels / best sum {rate['panels'] / max(rate[name] for name in sums):.2f}")
            print(line)
        del ways, sums, buffer
    use(default)
    suffix = (f"_{args.threads}t" if args.threads else "") + ("_prefetch" if args.prefetch else "") \
        + ("_streams" if args.streams else "")
    save("weight_streams" + suffix, {"rounds": args.rounds, "copies": args.copies, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
