"""Up to how many rows a product should read its panels as two streams per thread (`set_pair_rows`).

    python benchmarks/pair_rows.py                             # the 1.5B in every format, 1, default, 16
    python benchmarks/pair_rows.py --formats int4 --settings 1 5 8 --rows 1 5 8 9 --rounds 8

A one-row product reads each thread's region as two streams side by side, fetched
pair_prefetch() bytes ahead. A verification pass over several positions can read its panels
the same way (int8 and int4 tiles take two panels with up to 8 rows; float tiles take up to 3
and go through a block of the two panels in groups of rows, up to 16) or as one stream per
thread fetched stream_prefetch() bytes ahead. Integer and float panels have a limit each
(`pair_rows("integer")`, `pair_rows("float")`). For each weight format the model runs
forward passes over m positions with each setting in turn, round by round, so that a change
in the machine's load hits every setting alike; every setting's logits are first checked to
be bit-identical (the tiles sum in the same order). Prints r(m) = t(m) / t(1) per setting,
t(1) being the one-row step (which every setting reads as pairs), and how the default
compares with reading one stream.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, median, panel_kernels, processor, save, verdict, warn_if_busy

PROMPT = "def merge(a, b):\n    return sorted(a + b)\n"


@torch.inference_mode()
def measure(fmt: str, model_name: str, settings: list[int] | None, rows: list[int], rounds: int, steps: int,
            kernels) -> dict:
    from verispec.loading import load_model
    from verispec.quant import PACKED_FORMATS

    loaded = load_model(model_name, weights=fmt)
    model = loaded.model
    kind = "integer" if fmt in PACKED_FORMATS else "float"
    default = kernels.pair_rows(kind)
    settings = settings or sorted({1, default, 16})
    ids = loaded.tokenizer.encode(PROMPT)
    cache = model.new_cache(len(ids) + max(rows) + 1)
    model(torch.tensor([ids]), cache)
    start = cache.length
    seconds: dict[tuple[int, int], list[float]] = {}
    logits: dict[tuple[int, int], torch.Tensor] = {}
    try:
        for _ in range(rounds):
            for setting in settings:
                kernels.set_pair_rows(setting, kind)
                for m in rows:
                    times = []
                    for _ in range(steps + 1):  # the first pass warms up
                        cache.rollback(start)
                        started = time.perf_counter()
                        logits[setting, m] = model(torch.tensor([[100] * m]), cache)
                        times.append(time.perf_counter() - started)
                    seconds.setdefault((setting, m), []).append(median(times[1:]))
                    if not torch.equal(logits[setting, m], logits[settings[0], m]):
                        raise SystemExit(f"{fmt}: {m} rows give other logits with pairs up to {setting} rows")
    finally:
        kernels.set_pair_rows(default, kind)
    t = {key: median(values) for key, values in seconds.items()}
    r = {s: {m: t[s, m] / t[s, 1] for m in rows} for s in settings}
    for s in settings:
        mark = " (default)" if s == default else ""
        print(f"  {fmt:>8}, pairs up to {s} rows{mark}: t(1) {t[s, 1] * 1e3:.1f} ms, "
              + " ".join(f"r({m})={r[s][m]:.2f}" for m in rows if m > 1))
    if default in settings and 1 in settings and default != 1:
        for m in (m for m in rows if 1 < m <= default):
            print(verdict(f"{fmt}: {m} rows read as pairs against one stream",
                          f"{t[default, m] / t[1, m]:.3f}x the time", None))
    free(loaded, model, cache)
    return {"seconds": {f"{s}/{m}": value for (s, m), value in t.items()},
            "r": {str(s): {str(m): value for m, value in by_rows.items()} for s, by_rows in r.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--formats", nargs="+", default=["int4", "int8", "bfloat16", "float32"])
    parser.add_argument("--settings", type=int, nargs="+", default=None,
                        help="pair_rows values to compare (default: 1, the format's default and 16)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 17])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="passes per setting, size and round (their median counts)")
    parser.add_argument("--save-as", default="pair_rows", help="results/perf/<host>/<name>.json")
    args = parser.parse_args()
    kernels = panel_kernels()
    if kernels is None:
        return 1
    rows = sorted(set(args.rows) | {1})
    defaults = {kind: kernels.pair_rows(kind) for kind in ("integer", "float")}
    print(f"pair rows: {args.model}, {torch.get_num_threads()} threads, {processor()['name']}, "
          f"defaults {defaults}, {machine_load()}")
    warn_if_busy()
    results = {fmt: measure(fmt, args.model, args.settings, rows, args.rounds, args.steps, kernels)
               for fmt in args.formats}
    save(args.save_as, {"model": args.model, "defaults": defaults, "formats": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
