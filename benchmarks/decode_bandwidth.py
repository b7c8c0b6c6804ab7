"""Targets 1 and 3: how close plain decoding comes to the read bandwidth, per weight format,
and what a verification pass over m positions costs, r(m) = t(m) / t(1).

    python benchmarks/decode_bandwidth.py            # the 1.5B target in every format
    python benchmarks/decode_bandwidth.py --quick    # the 0.5B draft, int4 and int8, fewer repeats

Bandwidth utilisation = bytes of weights one step reads x tokens/s / measured read bandwidth,
with tokens/s from `generate` (the whole decoding loop, not just the forward pass). The read
bandwidth is the best of torch.sum and the kernels' streaming sum over 1 GiB, measured in
the same run. r(m) comes from forward passes over m positions on the same cache, the sizes
interleaved round by round so that a change in machine load hits them all alike.
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


def decode_rate(loaded, prompt_ids: list[int], tokens: int, repeats: int) -> float:
    from verispec.generate import generate

    rates = [generate(loaded, prompt_ids, max_tokens=tokens, ignore_eos=True).timings.tokens_per_s
             for _ in range(repeats)]
    return median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: qwen2.5-coder-1.5b (--quick: the 0.5B)")
    parser.add_argument("--formats", nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per decoding run")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model_name = args.model or ("qwen2.5-coder-0.5b" if args.quick else "qwen2.5-coder-1.5b")
    formats = args.formats or (["int4", "int8"] if args.quick else ["int4", "int8", "bfloat16", "float32"])
    tokens = args.tokens or (24 if args.quick else 64)
    repeats = 1 if args.quick else 3

    from verispec.loading import load_model

    print(f"decode bandwidth and verification cost: {model_name}, {torch.get_num_threads()} threads, "
          f"{machine_load()}")
    warn_if_busy()
    bandwidth = read_bandwidth(0.25 if args.quick else 1.0)
    print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for fmt in formats:
        loaded = load_model(model_name, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt)
        prompt_ids = loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        rate = decode_rate(loaded, prompt_ids, tokens, repeats)
        costs = verify_costs(loaded.model, prompt_ids, rounds=3 if args.quick else 7)
        bandwidth = max(bandwidth, read_bandwidth(0.25 if args.quick else 1.0, repeats=3))
        nbytes = loaded.weight_bytes()
        rows.append({"format": fmt, "weight_bytes": nbytes, "tok_s": rate, "t1_s": costs[1],
                     "r": {m: costs[m] / costs[1] for m in costs}, "bytes_per_s": nbytes * rate})
        print(f"  {fmt:>8}: {nbytes / 1e6:7.0f} MB/token, {rate:6.2f} tok/s, step {costs[1] * 1e3:6.1f} ms, "
              + " ".join(f"r({m})={costs[m] / costs[1]:.2f}" for m in costs if m > 1))
        free(loaded)
    print(f"  read bandwidth (best seen in this run) {bandwidth / 1e9:.1f} GB/s; {machine_load()}")
    all_met = True
    for row in rows:
        row["utilisation"] = row["bytes_per_s"] / bandwidth
        met = row["utilisation"] >= 0.85
        all_met &= met
        print(verdict(f"1 bandwidth, {row['format']}",
                      f"{row['bytes_per_s'] / 1e9:.1f} GB/s = {row['utilisation']:.0%} of read bandwidth (>= 85%)", met))
    fastest = min(rows, key=lambda r: r["t1_s"])  # the shortest step (measured interleaved, least noisy)
    r5, r9 = fastest["r"].get(5), fastest["r"].get(9)
    met3 = r5 is not None and r9 is not None and r5 <= 1.5 and r9 <= 2.5
    print(verdict(f"3 verification cost, fastest format {fastest['format']}",
                  f"r(5) = {r5:.2f} (<= 1.5), r(9) = {r9:.2f} (<= 2.5)", met3))
    save("decode_bandwidth" + ("_quick" if args.quick else ""),
         {"model": model_name, "read_bandwidth": bandwidth, "rows": rows})
    return 0 if (all_met and met3) or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
