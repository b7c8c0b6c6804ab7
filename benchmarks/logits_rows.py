"""Where keeping every position's logits goes when a prompt is read in large chunks.

    python benchmarks/logits_rows.py [--weights int8] [--rounds 3]

Three measurements in one process holding the 1.5B target:
- the output layer's product alone, per row, over 1 to 256 rows of hidden states;
- a pass over 256 positions with every row's logits: the fast path computes it as slices of
  KERNEL_MAX_ROWS (64) rows, and the time of each slice, of joining their logits into one
  tensor (torch.cat) and of the rest;
- writing a [256, vocab] float32 tensor just allocated against writing one already written:
  what the first touch of fresh memory (page faults) costs in this process.
With each, how many times the system stalled to compact memory for a huge page
(/proc/vmstat's compact_stall): verispec asks for transparent huge pages on large buffers
(THP_MEM_ALLOC_ENABLE, set on import), logits included; run with THP_MEM_ALLOC_ENABLE=0 to
compare.
"""

from __future__ import annotations

import argparse
import os
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, save, warn_if_busy
from scoring import prompt_of


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from verispec.kernels import cpu_kernels
    from verispec.loading import load_model
    from verispec.quant import KERNEL_MAX_ROWS

    target = load_model(args.model, weights=args.weights)
    model, vocab = target.model, target.config.vocab_size
    fast = model.fast_path
    if fast is None or cpu_kernels() is None:
        raise SystemExit("this measures the fast path, which needs the compiled kernels")
    print(f"logits over many rows: {target.name} ({args.weights}), {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}, {machine_load()}")
    warn_if_busy()
    record: dict = {"model": args.model, "weights": args.weights, "slice_rows": KERNEL_MAX_ROWS}

    head = fast._head(cpu_kernels(), None)
    record["head_ms_per_row"] = {}
    for rows in (1, 16, 64, 128, 256):
        x = torch.randn(rows, target.config.hidden_size)
        head(x)
        per_row = median([_timed(head, x) for _ in range(args.rounds * 2)]) / rows
        record["head_ms_per_row"][rows] = per_row * 1e3
        print(f"  output layer alone, {rows:3} rows: {per_row * 1e3:6.3f} ms per row")

    ids = torch.tensor([prompt_of(target.tokenizer, 256)])
    slices, joins, totals = [], [], []
    stalls = compaction_stalls()
    for _ in range(args.rounds):
        cache = model.new_cache(ids.shape[1] + 1)
        started = time.perf_counter()
        pieces = []
        for start in range(0, ids.shape[1], KERNEL_MAX_ROWS):
            t0 = time.perf_counter()
            pieces.append(fast._forward(ids[:, start:start + KERNEL_MAX_ROWS], cache, last_only=False))
            slices.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        joined = torch.cat(pieces, dim=1)
        joins.append(time.perf_counter() - t0)
        totals.append(time.perf_counter() - started)
        del pieces, joined
    pass_stalls = (compaction_stalls() - stalls) / args.rounds
    record.update(slice_s=median(slices), join_s=median(joins), pass_s=median(totals), pass_stalls=pass_stalls)
    print(f"  a 256-position pass with every row's logits: {median(totals):.3f} s; each {KERNEL_MAX_ROWS}-row "
          f"slice {median(slices):.3f} s, joining their logits {median(joins):.3f} s; "
          f"{pass_stalls:.0f} compaction stalls a pass")

    fresh, touched = [], []
    stalls = compaction_stalls()
    kept = torch.empty(256, vocab)
    kept.fill_(0.0)
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        torch.empty(256, vocab).fill_(1.0)
        fresh.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kept.fill_(1.0)
        touched.append(time.perf_counter() - t0)
    fill_stalls = (compaction_stalls() - stalls) / args.rounds
    record.update(fresh_fill_s=median(fresh), touched_fill_s=median(touched), fill_stalls=fill_stalls,
                  huge_pages=os.environ.get("THP_MEM_ALLOC_ENABLE"))
    print(f"  writing [256, {vocab:,}] float32: just allocated {median(fresh) * 1e3:.1f} ms, already written "
          f"{median(touched) * 1e3:.1f} ms ({median(fresh) / median(touched):.0f}x); {fill_stalls:.0f} compaction "
          f"stalls a round")
    save("logits_rows" if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else "logits_rows_small_pages", record)


def compaction_stalls() -> int:
    """How often the system has stalled an allocation to compact memory (0 where unknown)."""
    try:
        for line in open("/proc/vmstat"):
            if line.startswith("compact_stall "):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
