"""Targets 1 and 3: how close plain decoding comes to the read bandwidth, per weight format,
and what a verification pass over m positions costs, r(m) = t(m) / t(1).

    python benchmarks/decode_bandwidth.py            # the 1.5B target in every format
    python benchmarks/decode_bandwidth.py --quick    # the 0.5B draft, int4 and int8, fewer repeats

Bandwidth utilisation = bytes of weights one step reads x tokens/s / measured read bandwidth,
with tokens/s from `generate` (the whole decoding loop, not just the forward pass). The read
bandwidth is the best of torch.sum and the kernels' streaming sums over 0.5 GiB. This
machine's bandwidth drifts by a third within minutes as other jobs come and go, so each
format decodes in several short runs, each run between two bandwidth measurements: its
utilisation is its bytes/s over the higher of the two, and the figure is the median over
the runs whose two measurements agree within 10% (a run during which the bandwidth jumped
says nothing about either level; all runs count if none is steady). The best bandwidth
seen in the whole run, and each format's share of it, are printed too. r(m) comes from
forward passes over m positions on the same cache, the sizes interleaved round by round so
that a change in machine load hits them all alike. Each run's summary is appended to
results/perf/<host>/decode_bandwidth_history.jsonl.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, median, read_bandwidth, save, verdict, warn_if_busy

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
SIZES = (1, 2, 3, 5, 9, 17)


@torch.inference_mode()
def verify_costs(model, prompt_ids: list[int], sizes=SIZES, rounds: int = 7) -> dict[int, float]:
    """Median seconds of a forward pass over m positions after the prompt, for each m."""
    cache = model.new_cache(len(prompt_ids) + max(sizes) + 1)
    model(torch.tensor([prompt_ids]), cache)
    length = cache.length
    feed = torch.tensor([prompt_ids[:max(sizes)]])
    times: dict[int, list[float]] = {m: [] for m in sizes}
    import time
    for round_index in range(rounds + 1):
        for m in sizes:
            cache.rollback(length)
            started = time.perf_counter()
            model(feed[:, :m], cache)
            if round_index:  # the first round warms up
                times[m].append(time.perf_counter() - started)
    return {m: median(t) for m, t in times.items()}


def decode_runs(loaded, prompt_ids: list[int], tokens: int, runs: int, gib: float) -> list[dict]:
    """`runs` decoding runs, each between two read-bandwidth measurements."""
    from verispec.generate import generate

    generate(loaded, prompt_ids, max_tokens=4, ignore_eos=True)  # warm-up: layouts, caches
    nbytes = loaded.weight_bytes()
    records = []
    before = read_bandwidth(gib, repeats=2, keep=True)
    for _ in range(runs):
        rate = generate(loaded, prompt_ids, max_tokens=tokens, ignore_eos=True).timings.tokens_per_s
        after = read_bandwidth(gib, repeats=2, keep=True)
        records.append({"tok_s": rate, "bandwidth_before": before, "bandwidth_after": after,
                        "utilisation": nbytes * rate / max(before, after)})
        before = after
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: qwen2.5-coder-1.5b (--quick: the 0.5B)")
    parser.add_argument("--formats", nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per decoding run")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model_name = args.model or ("qwen2.5-coder-0.5b" if args.quick else "qwen2.5-coder-1.5b")
    formats = args.formats or (["int4", "int8"] if args.quick else ["int4", "int8", "bfloat16", "float32"])
    tokens = args.tokens or (24 if args.quick else 48)
    runs = 2 if args.quick else 5
    gib = 0.25 if args.quick else 0.5

    from verispec.loading import load_model

    print(f"decode bandwidth and verification cost: {model_name}, {torch.get_num_threads()} threads, "
          f"{machine_load()}")
    warn_if_busy()
    rows = []
    for fmt in formats:
        loaded = load_model(model_name, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt)
        prompt_ids = loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        records = decode_runs(loaded, prompt_ids, tokens, runs, gib)
        costs = verify_costs(loaded.model, prompt_ids, rounds=3 if args.quick else 7)
        nbytes, rate = loaded.weight_bytes(), median([r["tok_s"] for r in records])
        steady = [r for r in records if min(r["bandwidth_before"], r["bandwidth_after"])
                  >= 0.9 * max(r["bandwidth_before"], r["bandwidth_after"])] or records
        utilisation = median([r["utilisation"] for r in steady])
        seen = [b for r in records for b in (r["bandwidth_before"], r["bandwidth_after"])]
        rows.append({"format": fmt, "weight_bytes": nbytes, "tok_s": rate, "t1_s": costs[1],
                     "r": {m: costs[m] / costs[1] for m in costs}, "bytes_per_s": nbytes * rate,
                     "utilisation": utilisation, "steady_runs": len(steady),
                     "bandwidth_around": [min(seen), max(seen)], "runs": records})
        print(f"  {fmt:>8}: {nbytes / 1e6:7.0f} MB/token, {rate:6.2f} tok/s, step {costs[1] * 1e3:6.1f} ms, "
              + " ".join(f"r({m})={costs[m] / costs[1]:.2f}" for m in costs if m > 1)
              + f"; read bandwidth around its runs {min(seen) / 1e9:.1f}-{max(seen) / 1e9:.1f} GB/s, "
              f"{len(steady)} of {len(records)} runs steady")
        free(loaded)
    best = max(row["bandwidth_around"][1] for row in rows)
    print(f"  read bandwidth: best seen in this run {best / 1e9:.1f} GB/s; {machine_load()}")
    all_met = True
    for row in rows:
        met = row["utilisation"] >= 0.85
        all_met &= met
        print(verdict(f"1 bandwidth, {row['format']}",
                      f"{row['bytes_per_s'] / 1e9:.1f} GB/s; median over steady runs {row['utilisation']:.0%} of "
                      f"the read bandwidth measured around each (>= 85%); {row['bytes_per_s'] / best:.0%} of the best "
                      f"seen in the run", met))
    bandwidth = best
    fastest = min(rows, key=lambda r: r["t1_s"])  # the shortest step (measured interleaved, least noisy)
    r5, r9 = fastest["r"].get(5), fastest["r"].get(9)
    met3 = r5 is not None and r9 is not None and r5 <= 1.5 and r9 <= 2.5
    print(verdict(f"3 verification cost, fastest format {fastest['format']}",
                  f"r(5) = {r5:.2f} (<= 1.5), r(9) = {r9:.2f} (<= 2.5)", met3))
    summary = {"model": model_name, "best_bandwidth": best,
               "formats": {row["format"]: {"tok_s": row["tok_s"], "utilisation": row["utilisation"],
                                           "steady_runs": row["steady_runs"],
                                           "bandwidth_around": row["bandwidth_around"],
                                           "r5": row["r"].get(5), "r9": row["r"].get(9)} for row in rows}}
    save("decode_bandwidth" + ("_quick" if args.quick else ""),
         {"model": model_name, "read_bandwidth": bandwidth, "rows": rows}, history=summary)
    return 0 if (all_met and met3) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
