"""How the weights' place in memory and the threads' streams change a decoding step (1.5B target).

    python benchmarks/stream_layout.py                   # int8 and int4, 12 rounds
    python benchmarks/stream_layout.py --formats int4 --rounds 30

Each format is loaded twice: as `load_model` leaves it, every layer's panels in one buffer
(`quant.panels_in_one_buffer`), and with each layer's panels in a buffer of its own (as
layers switched to panels on first use before), whose last part lies on 4 KB pages. Each
copy runs one-row forward passes (a plain decoding step, without sampling) with each
thread reading its region of the panels as one stream, fetched ahead in software, and as
two streams, its halves side by side (`set_panel_streams`). The four ways take turns step by step
within each round, and each round sits between two read-bandwidth measurements. A way's
utilisation in a round is bytes of weights read per second over the higher of the two;
the figures are medians over the rounds whose two measurements agree within 10%, given
apart for the host's fast and slow spells.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, median, panel_kernels, read_bandwidth, save, warn_if_busy

PROMPT = "def merge(a, b):\n    return sorted(a + b)\n"


def load_both(name: str, fmt: str):
    """The model as loaded, and a copy whose layers keep their panels in buffers of their own."""
    import verispec.quant
    from verispec.loading import load_model

    one_buffer = load_model(name, "float32", weights=fmt)
    gather = verispec.quant.panels_in_one_buffer
    verispec.quant.panels_in_one_buffer = lambda model, kernels: None  # layers switch on first use
    try:
        separate = load_model(name, "float32", weights=fmt)
    finally:
        verispec.quant.panels_in_one_buffer = gather
    return one_buffer, separate


@torch.inference_mode()
def measure(fmt: str, name: str, rounds: int, steps: int, kernels) -> dict:
    one_buffer, separate = load_both(name, fmt)
    nbytes = one_buffer.weight_bytes()
    ids = one_buffer.tokenizer.encode(PROMPT)
    feed = torch.tensor([ids[:1]])
    copies = {}
    for label, loaded in (("one buffer", one_buffer), ("a buffer per layer", separate)):
        cache = loaded.model.new_cache(len(ids) + 2)
        loaded.model(torch.tensor([ids]), cache)  # the prompt; the separate copy switches to panels here
        copies[label] = (loaded.model, cache, cache.length)
    ways = [(label, streams) for label in copies for streams in (1, 2)]
    default = kernels.panel_streams()
    records = []
    try:
        for _ in range(rounds):
            before = read_bandwidth(0.5, repeats=2, keep=True)
            times: dict[tuple, list[float]] = {way: [] for way in ways}
            for _ in range(steps):
                for way in ways:
                    model, cache, length = copies[way[0]]
                    kernels.set_panel_streams(way[1])
                    cache.rollback(length)
                    started = time.perf_counter()
                    model(feed, cache)
                    times[way].append(time.perf_counter() - started)
            kernels.set_panel_streams(default)
            after = read_bandwidth(0.5, repeats=2, keep=True)
            records.append({"bandwidth_before": before, "bandwidth_after": after,
                            "utilisation": {f"{label}, {streams} stream{'s' if streams > 1 else ''}":
                                            nbytes / median(t) / max(before, after)
                                            for (label, streams), t in times.items()}})
    finally:
        kernels.set_panel_streams(default)
    return {"format": fmt, "weight_bytes": nbytes, "rounds": records, "spells": spells(records)}


def spell_groups(records: list[dict]) -> dict[str, list[dict]]:
    """The steady rounds (bandwidth before and after within 10%), apart for the host's fast
    spells (read bandwidth within 80% of the best steady round) and the rest: this host's
    bandwidth moves between two levels, and the streams matter most at the higher one. A run
    that stayed at one level, whichever it was, has one group, "single"."""
    steady = [r for r in records if min(r["bandwidth_before"], r["bandwidth_after"])
              >= 0.9 * max(r["bandwidth_before"], r["bandwidth_after"])] or records
    best = max(_level(r) for r in steady)
    groups = {"fast": [r for r in steady if _level(r) >= 0.8 * best],
              "slow": [r for r in steady if _level(r) < 0.8 * best]}
    if not groups["slow"]:
        return {"single": groups["fast"]}
    return {name: group for name, group in groups.items() if group}


def spells(records: list[dict]) -> dict:
    """Median utilisation of each way over each spell's steady rounds (`spell_groups`)."""
    return {name: {"rounds": len(group), "bandwidth": [min(map(_level, group)), max(map(_level, group))],
                   "utilisation": {way: median([r["utilisation"][way] for r in group]) for way in group[0]["utilisation"]}}
            for name, group in spell_groups(records).items()}


def time_ratio(group: list[dict], way: str, against: str) -> float:
    """Median over a spell's rounds of one way's seconds over another's in the same round."""
    return median([r["seconds"][way] / r["seconds"][against] for r in group])


def _level(record: dict) -> float:
    return max(record["bandwidth_before"], record["bandwidth_after"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10, help="steps per way and round")
    args = parser.parse_args()

    kernels = panel_kernels()
    if kernels is None:
        return 1
    print(f"stream layout: {args.model}, {torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    results = []
    for fmt in args.formats:
        row = measure(fmt, args.model, args.rounds, args.steps, kernels)
        free()  # both copies of the model went with measure's frame
        results.append(row)
        for name, spell in row["spells"].items():
            low, high = spell["bandwidth"]
            print(f"  {fmt}, {name} spell ({spell['rounds']} steady rounds, {low / 1e9:.0f}-{high / 1e9:.0f} GB/s): "
                  + ", ".join(f"{way} {u:.0%}" for way, u in spell["utilisation"].items()))
    save("stream_layout", {"model": args.model, "results": results},
         history={"model": args.model, "spells": {row["format"]: row["spells"] for row in results}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
