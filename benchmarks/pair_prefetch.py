"""How far ahead a step's products should fetch their weights in software, at one position or many.

    python benchmarks/pair_prefetch.py                         # the 1.5B in every format, 0 to 2 KB
    python benchmarks/pair_prefetch.py --formats int4 --distances 0 1024 1536 --rounds 12
    python benchmarks/pair_prefetch.py --formats int4 int8 --positions 5 --distances 0 512 1024 2048
    python benchmarks/pair_prefetch.py --formats int4 --positions 9 --distances 2048 4096 20480
    python benchmarks/pair_prefetch.py --formats int4 int8 --distances 1536 4096 --save-as pair_prefetch_far
    python benchmarks/pair_prefetch.py --knob pair-l2 --distances 0 2048 3072 4096 --save-as pair_prefetch_l2
    python benchmarks/pair_prefetch.py --knob pass-pair-l2 --formats int8 int4 --positions 5 --distances 0 3072
    python benchmarks/pair_prefetch.py --knob helper --distances 0 16384 32768 65536 --save-as pair_prefetch_helper

A plain decoding step reads each thread's region of a product's panels as two streams side
by side. How well the hardware prefetcher alone keeps them fed depends on the processor: on
an AMD EPYC (Zen 4) fetching them in software read less, on an Intel Xeon the hardware alone
left every format well short of the read bandwidth. A verification pass (--positions M)
spends longer on each line, and its distance is a knob of its own: passes of a few rows that
read pairs use the one-row distance (`pair`), passes of `pass_pair_rows` rows or more (5;
bfloat16 3) that read pairs `pass-pair`, and passes with more rows than the format reads as
pairs one stream per thread (`pass-stream`); one-row products read one stream per thread
(`stream`) only under `set_panel_streams(1)`. Where pairs are fetched in software, they are
also fetched into L2 further ahead (`pair-l2`; 0 or no further than the first: not at all),
integer passes of `pass_pair_rows` rows or more by a knob of their own (`pass-pair-l2`).
While the calling thread does a layer's serial work (a norm, SwiGLU), the helper threads
read the start of their regions of the product that follows, this many bytes of each stream
(`helper`; 0: nothing). --knob picks one; by default it is the one the kernels use for M
positions in each format.

For each weight format the model runs forward passes over M positions after a short prompt
(no sampling) with each distance in turn, step by step within each round, each round between
two read-bandwidth measurements (perf_common.take_turns), and every distance's logits are
first checked to be bit-identical to the others' (prefetching moves no arithmetic). The host's
bandwidth moves between a slow and a fast level, so the rounds are split by spell as
`stack_ab.py` splits them: per spell, each distance's share of the read bandwidth (bytes of
weights per step over the higher of the two measurements) and its step time as a ratio of
the default distance's in the same rounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, median, panel_kernels, processor, save, take_turns, verdict, warn_if_busy
from stream_layout import spell_groups, spells, time_ratio

PROMPT = "def merge(a, b):\n    return sorted(a + b)\n"
KNOBS = ("pair", "pass-pair", "pass-stream", "stream", "pair-l2", "pass-pair-l2", "helper")


def knob_at(kernels, fmt: str, positions: int) -> str:
    """The distance the kernels use for a step of `positions` positions in `fmt` (the
    branches of for_each_panel_tile)."""
    kind = "integer" if fmt in ("int4", "int8") else "float"
    if kernels.panel_streams() == 2 and positions <= kernels.pair_rows(kind):
        return "pass-pair" if positions >= kernels.pass_pair_rows(fmt) else "pair"
    return "stream" if positions == 1 else "pass-stream"


def get_distance(kernels, knob: str) -> int:
    return getattr(kernels, knob.replace("-", "_") + "_prefetch")()


def set_distance(kernels, knob: str, distance: int) -> None:
    getattr(kernels, "set_" + knob.replace("-", "_") + "_prefetch")(distance)


def step_timer(model, cache, start: int, tokens: list[int], steps: int, kernels, knob: str, distance: int,
               logits: dict):
    batch = torch.tensor([tokens])

    @torch.inference_mode()
    def timed() -> float:
        default = get_distance(kernels, knob)
        set_distance(kernels, knob, distance)
        try:
            times = []
            for _ in range(steps + 1):  # the first step warms up
                cache.rollback(start)
                started = time.perf_counter()
                logits[distance] = model(batch, cache, last_only=len(tokens) == 1)
                times.append(time.perf_counter() - started)
        finally:
            set_distance(kernels, knob, default)
        return median(times[1:])
    return timed


def measure(fmt: str, args, kernels) -> dict:
    from verispec.loading import load_model

    knob = args.knob or knob_at(kernels, fmt, args.positions)
    default = get_distance(kernels, knob)
    distances = args.distances if default in args.distances else [default, *args.distances]
    loaded = load_model(args.model, weights=fmt)
    model = loaded.model
    ids = loaded.tokenizer.encode(PROMPT)
    cache = model.new_cache(len(ids) + args.positions + 1)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache)
    tokens = ids[-args.positions:]
    logits: dict[int, torch.Tensor] = {}
    timers = {d: step_timer(model, cache, cache.length, tokens, args.steps, kernels, knob, d, logits)
              for d in distances}
    for timer in timers.values():
        timer()
    first = logits[distances[0]]
    if not all(torch.equal(first, logits[d]) for d in distances):
        raise SystemExit(f"{fmt}: the logits differ between prefetch distances")
    records = take_turns(timers, args.rounds, loaded.weight_bytes())
    summary = spells(records)
    print(f"  {fmt} over {args.positions} position(s), the {knob} distance (default {default} B):")
    for spell, group in spell_groups(records).items():
        result = summary[spell]
        result["time_vs_default"] = {d: time_ratio(group, d, default) for d in distances}
        low, high = result["bandwidth"]
        print(f"    {spell} spell, {result['rounds']} steady rounds at {low / 1e9:.0f}-{high / 1e9:.0f} GB/s: "
              + "; ".join(f"{d} B {result['utilisation'][d]:.0%} ({result['time_vs_default'][d]:.3f}x)"
                          for d in distances))
        best = min(distances, key=result["time_vs_default"].get)
        print("    " + verdict(f"{fmt}, {spell} spell: the fastest distance ({best} B) against the default",
                               f"{result['time_vs_default'][best]:.3f}x the default's step time", None))
    seconds = {d: median([r["seconds"][d] for r in records]) for d in distances}
    free(loaded, model, cache)
    return {"knob": knob, "default": default, "seconds": seconds, "spells": summary, "rounds": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", nargs="+", default=["int4", "int8", "bfloat16", "float32"])
    parser.add_argument("--positions", type=int, default=1, help="positions per step (γ + 1 for a verification pass)")
    parser.add_argument("--knob", choices=KNOBS, default=None,
                        help="the distance to vary (default: the one the kernels use at --positions in each format)")
    parser.add_argument("--distances", type=int, nargs="+", default=[0, 512, 1024, 1536, 2048])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per distance and round (their median counts)")
    parser.add_argument("--save-as", default=None,
                        help="results/perf/<host>/<name>.json (default: pair_prefetch, or pair_prefetch_p<M> for M positions)")
    args = parser.parse_args()
    kernels = panel_kernels()
    if kernels is None:
        return 1
    print(f"prefetch distances: {args.model}, {args.positions} position(s) per step, "
          f"{torch.get_num_threads()} threads, {processor()['name']}, {machine_load()}")
    warn_if_busy()
    results = {fmt: measure(fmt, args, kernels) for fmt in args.formats}
    name = args.save_as or ("pair_prefetch" if args.positions == 1 else f"pair_prefetch_p{args.positions}")
    save(name, {"model": args.model, "positions": args.positions, "formats": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
