"""What the penalties cost a speculative round's rows, outside the model, and where it goes.

    python benchmarks/penalty_cost.py
    python benchmarks/penalty_cost.py --context 4096 --gamma 8
    python benchmarks/penalty_cost.py --keep-freed-memory      # glibc keeps freed blocks for reuse

With presence, frequency and repetition penalties on, a request's rows are penalised before
each choice (`PenaltyState.apply`): a plain step's one row, each draft step's row (through the
limited draft's columns: its first 32,768 ids and the context's), and the verification pass's
γ + 1 rows, each of which also counts the drafts before it: greedy verification's (its rows
written where the last pass's were, every row's own ids penalised in one call), and the same
pass as it was before (a fresh copy, a call per id and row), checked to give the same bits.
Each is timed on rows of Qwen2.5's 151,936 logits after a prompt and an output of --context
ids between them, the kinds in turn; so is the first call after the output grows, which
gathers the context's ids again (once a round for each model), and a fresh copy of a pass's
rows against a copy into memory written before.

A fresh tensor of 2 MB or more gets new transparent huge pages from the kernel (verispec sets
THP_MEM_ALLOC_ENABLE for the weights' sake), zeroed on first touch, whenever glibc has handed
the last such block back. --keep-freed-memory raises glibc's trim and mmap thresholds first
(mallopt), so that freed blocks stay for the next allocation.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from freed_memory import keep_freed_memory  # it imports no torch

if __name__ == "__main__" and "--keep-freed-memory" in sys.argv:
    keep_freed_memory()  # before torch allocates anything

import verispec  # noqa: E402,F401  (before torch: it sets how torch's threads wait)
import torch  # noqa: E402

from perf_common import machine_load, median, rotated, save, warn_if_busy  # noqa: E402

VOCAB, DRAFT_IDS = 151_936, 32_768


def apply_as_before(state, logits: torch.Tensor, drafts=(), before=(), column_of=None, reuse=False) -> torch.Tensor:
    """PenaltyState.apply as it was: a fresh copy of the rows (`reuse` is taken and ignored), and
    the ids a row's own drafts add penalised one call per id and row (no logit bias or
    min_tokens here)."""
    from verispec.penalties import _column

    width = logits.shape[-1]
    out = logits.clone()
    columns, counts = state._columns(
        "context", (column_of, width, logits.device),
        lambda: [(i, state.generated[i]) for i in sorted(state.prompt | state.generated.keys())])
    if columns.numel():
        out[:, columns] = state.penalties.penalised(logits[:, columns], counts)
    for row in range(logits.shape[0]):
        for token, extra in Counter([*before, *drafts[:row]]).items():
            column = _column(token, width, column_of)
            if column is not None:
                count = torch.tensor([state.generated[token] + extra], dtype=torch.float32)
                out[row, column:column + 1] = state.penalties.penalised(logits[row, column:column + 1], count)
    return out


def calls_of_a_round(state, column_map, gamma: int, rng: random.Random) -> dict[str, dict]:
    """The calls a round makes: (logits, drafts, before, column_of) for each kind of row."""
    drafts = [rng.choice(sorted(state.generated)) for _ in range(gamma)]  # drafts repeat the output's ids
    return {
        "plain step (1 row)": dict(logits=torch.randn(1, VOCAB), drafts=[], before=[], column_of=None),
        f"draft step ({gamma // 2} drafts before)": dict(logits=torch.randn(1, DRAFT_IDS + 64), drafts=[],
                                                          before=drafts[:gamma // 2], column_of=column_map),
        f"verification pass ({gamma + 1} rows)": dict(logits=torch.randn(gamma + 1, VOCAB), drafts=drafts,
                                                      before=[], column_of=None, reuse=True),
    }


def timed(ways: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median seconds a call of each way, the ways in turn, the first moving from round to round."""
    times = {name: [] for name in ways}
    for round_ in range(rounds):
        for name in rotated(list(ways), round_):
            way = ways[name]
            started = time.perf_counter()
            for _ in range(calls):
                way()
            times[name].append((time.perf_counter() - started) / calls)
    return {name: median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512, help="ids of prompt and output")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--keep-freed-memory", action="store_true", help="raise glibc's thresholds first")
    args = parser.parse_args()

    from verispec.penalties import Penalties, PenaltyState
    from verispec.spec.draft_model import ColumnMap

    rng = random.Random(0)
    context = [rng.randrange(VOCAB) for _ in range(args.context)]
    half = args.context // 2
    state = PenaltyState(Penalties(presence=0.5, frequency=0.5, repetition=1.1), context[:half])
    state.add(context[half:])  # and a token more with every call of the growing way
    above = sorted({i for i in context if i >= DRAFT_IDS})[:64]
    column_map = ColumnMap(DRAFT_IDS, above, {token: DRAFT_IDS + k for k, token in enumerate(above)})
    memory = "freed memory kept by glibc" if args.keep_freed_memory else "glibc's default thresholds"
    print(f"the penalties' cost per call: presence 0.5, frequency 0.5, repetition 1.1, {args.context} ids of "
          f"context, γ = {args.gamma}, {memory}, {torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    calls = calls_of_a_round(state, column_map, args.gamma, rng)
    pass_rows = calls[f"verification pass ({args.gamma + 1} rows)"]["logits"]
    written = torch.empty_like(pass_rows)

    def grown() -> None:  # the output grows by a token and the context's ids are gathered again
        state.add([rng.randrange(VOCAB)])
        state.apply(calls["plain step (1 row)"]["logits"])

    ways = {name: (lambda call=call: state.apply(**call)) for name, call in calls.items()}
    pass_call = calls[f"verification pass ({args.gamma + 1} rows)"]
    ways["the pass as before"] = lambda: apply_as_before(state, **pass_call)
    ways["first call after a token joins"] = grown
    ways["a fresh copy of the pass's rows"] = pass_rows.clone
    ways["a copy into memory written before"] = lambda: written.copy_(pass_rows)
    with torch.inference_mode():
        if not torch.equal(state.apply(**pass_call), apply_as_before(state, **pass_call)):
            print("  the pass's rows differ from the earlier way's")
            return 1
        seconds = timed(ways, args.calls, args.rounds)
    for name, value in seconds.items():
        print(f"  {name:>34}: {value * 1e6:7.0f} µs")
    save("penalty_cost_kept" if args.keep_freed_memory else "penalty_cost",
         {"context": args.context, "gamma": args.gamma, "keep_freed_memory": args.keep_freed_memory,
          "seconds": seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
