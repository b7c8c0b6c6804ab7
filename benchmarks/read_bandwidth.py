"""How fast this machine reads memory by the size of the buffer read: is the scripts' reference
larger than what the caches can keep? And by the number of threads reading: does one core
read what two do?

    python benchmarks/read_bandwidth.py                       # 0.25 to 4 GiB, 8 rounds; 1 and 2 threads
    python benchmarks/read_bandwidth.py --sizes 0.5 2 --rounds 12 --threads 1 2

Every share of "the read bandwidth" the scripts print is over perf_common.read_bandwidth: the
best of several sums over one buffer, of 0.5 or 1 GiB. If a part of that buffer were still in
the last-level cache when it is read again, the reference would read faster than memory and
every share would come out too low: a cache whose replacement resists streams can keep a part
of a buffer a few times its own size, and these hosts report last-level caches of 8 MB to
480 MB. The sizes here take turns round by round (a change in machine load hits them alike);
per size, the median over rounds and its ratio to the largest size's.

The same reference read by fewer threads (1 GiB) tells what bounds it: where one core reads
half of what two do, each core is held to how many reads it keeps in flight, and a kernel
that reads a little less per core than the sum does loses that share of the whole; where one
core reads nearly what two do, the memory itself is the limit.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import last_level_cache, machine_load, median, read_bandwidth, rotated, save, verdict, warn_if_busy


def by_size(sizes: list[float], rounds: int, repeats: int = 2) -> dict[float, list[float]]:
    """Per buffer size (GiB), the reference's bytes/s in each round, the sizes taking turns."""
    seen: dict[float, list[float]] = {size: [] for size in sizes}
    for index in range(rounds):
        for size in rotated(list(sizes), index):
            seen[size].append(read_bandwidth(size, repeats=repeats, keep=True))
    return seen


def by_threads(threads: list[int], gib: float, rounds: int, repeats: int = 2) -> dict[int, list[float]]:
    """Per thread count, the reference's bytes/s in each round over one buffer of `gib`, the
    counts taking turns; the thread count as it was after."""
    seen: dict[int, list[float]] = {count: [] for count in threads}
    before = torch.get_num_threads()
    try:
        for index in range(rounds):
            for count in rotated(list(threads), index):
                torch.set_num_threads(count)
                seen[count].append(read_bandwidth(gib, repeats=repeats, keep=True))
    finally:
        torch.set_num_threads(before)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0], help="GiB")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts to read 1 GiB with (default: 1 and all; 0 skips)")
    args = parser.parse_args(argv)

    llc = last_level_cache()
    print(f"read bandwidth by buffer size: {torch.get_num_threads()} threads, last-level cache "
          f"{llc / (1 << 20):,.0f} MB as the system reports it, {machine_load()}")
    warn_if_busy()
    sizes = sorted(args.sizes)
    seen = by_size(sizes, args.rounds)
    largest = median(seen[sizes[-1]])
    rows = []
    for size in sizes:
        level = median(seen[size])
        rows.append({"gib": size, "median": level, "low": min(seen[size]), "high": max(seen[size]),
                     "to_largest": level / largest})
        print(f"  {size:5.2f} GiB: {level / 1e9:5.1f} GB/s median ({min(seen[size]) / 1e9:.1f}-"
              f"{max(seen[size]) / 1e9:.1f}), {level / largest:.3f}x the {sizes[-1]:g} GiB buffer's")
    inflated = [row for row in rows if row["to_largest"] > 1.03]
    print(verdict("reference", "buffers that read over 3% faster than the largest: "
                  + (", ".join(f"{row['gib']:g} GiB" for row in inflated) or "none")
                  + " (the scripts read 0.5 or 1 GiB)", None))
    by_count = []
    counts = sorted({count for count in (args.threads or [1, torch.get_num_threads()]) if count > 0})
    if counts:
        seen_threads = by_threads(counts, 1.0, args.rounds)
        fewest = median(seen_threads[counts[0]])
        for count in counts:
            level = median(seen_threads[count])
            by_count.append({"threads": count, "median": level, "to_fewest": level / fewest})
            print(f"  {count} thread{'s' if count > 1 else ''}: {level / 1e9:5.1f} GB/s median over 1 GiB, "
                  f"{level / fewest:.2f}x {counts[0]} thread{'s' if counts[0] > 1 else ''}'s")
    save("read_bandwidth", {"last_level_cache": llc, "rounds": args.rounds, "rows": rows, "threads": by_count},
         history={"rows": [{k: row[k] for k in ("gib", "median", "to_largest")} for row in rows],
                  "threads": by_count})
    return 0


if __name__ == "__main__":
    sys.exit(main())
