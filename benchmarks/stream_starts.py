"""Do a step's stream starts cost bandwidth? The same bytes read as pieces one after another,
each piece one parallel call with two streams per thread (as a one-row product reads its
panels), either in place (every piece starts its four streams afresh, as every product of a
decoding step does) or with each stream continuing where its part of the piece before ended.

    python benchmarks/stream_starts.py                      # pieces of 2, 8.6 and 17.2 MB
    python benchmarks/stream_starts.py --sizes-mb 1 4 --rounds 40

The sizes default to the 1.5B's int4 products per layer: q/k/v and o (about 2 MB), down
(8.6 MB) and gate_up (17.2 MB). Every way reads the same 512 MB buffer; the ways take turns
round by round, each round between two read-bandwidth measurements, and the medians are split
by the host's spells as `stack_ab.py` splits them. If continuous streams read clearly more,
a layout that keeps each thread's streams unbroken from product to product (the weights in
one arena per thread and stream, in run order) would gain that much of a step.
"""

from __future__ import annotations

import argparse
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, save, take_turns, warn_if_busy
from stream_layout import spell_groups, spells, time_ratio


def way_name(size_mb: float, continuous: bool) -> str:
    return f"{size_mb:g} MB {'continuous' if continuous else 'in place'}"


def timed(kernels, buffer: torch.Tensor, pieces: int, continuous: bool, repeats: int) -> float:
    """Median seconds of one pass over the buffer."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        kernels.stream_pieces(buffer, pieces, continuous)
        times.append(time.perf_counter() - started)
    return median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[2.0, 8.6, 17.2])
    parser.add_argument("--buffer-mb", type=int, default=512, help="far larger than the last-level cache")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="passes per way and round (their median counts)")
    args = parser.parse_args()

    from verispec.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not hasattr(kernels, "stream_pieces"):
        print("the CPU kernels are not built here")
        return 1
    buffer = torch.ones(args.buffer_mb * 2**20 // 4)
    ways = {way_name(size, continuous): (max(1, round(args.buffer_mb / size)), continuous)
            for size in args.sizes_mb for continuous in (False, True)}
    print(f"{args.buffer_mb} MB read as pieces of {', '.join(f'{s:g}' for s in args.sizes_mb)} MB, "
          f"{torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    for pieces, continuous in ways.values():
        kernels.stream_pieces(buffer, pieces, continuous)  # warm-up: pages, helper threads

    timers = {name: lambda way=way: timed(kernels, buffer, *way, args.repeats) for name, way in ways.items()}
    records = take_turns(timers, args.rounds, buffer.numel() * 4)
    summary = spells(records)
    for spell, group in spell_groups(records).items():
        result = summary[spell]
        low, high = result["bandwidth"]
        print(f"{spell} spell: {result['rounds']} steady rounds at {low / 1e9:.0f}-{high / 1e9:.0f} GB/s")
        for size in args.sizes_mb:
            fresh, kept = way_name(size, False), way_name(size, True)
            ratio = time_ratio(group, fresh, kept)
            result.setdefault("in_place_time_vs_continuous", {})[f"{size:g}"] = ratio
            print(f"  pieces of {size:g} MB: in place {result['utilisation'][fresh]:.1%}, continuous "
                  f"{result['utilisation'][kept]:.1%} of the read bandwidth; in place takes {ratio:.4f}x as long")
    save("stream_starts", {"buffer_mb": args.buffer_mb, "sizes_mb": args.sizes_mb, "spells": summary,
                           "rounds": records}, history={"spells": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
