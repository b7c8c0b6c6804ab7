"""Speculative decoding while a code model fills in the middle (`suffix`): HumanEval's
functions with their bodies cut out, the target writing each body between the signature and
docstring (the prompt) and the body's last line (the suffix).

    python benchmarks/infill.py                       # 8 problems, γ = 5, up to 128 tokens
    python benchmarks/infill.py --problems 4 --gamma 4

Needs the `bench` extra (`make bench`) for HumanEval's problems. The problems are spread over
HumanEval's 164, those whose canonical body has fewer than 3 lines left out. For each one:
plain decoding, speculative decoding with the draft model and with prompt lookup (the two in
turn: each problem swaps which runs first), plain decoding again, one after the other, so a
change in machine load hits them alike. Speed-up = plain time per token / speculative time per
token; VALID when the speculative tokens equal both plain runs'. "Ended" counts the middles the
model closed itself (an end-of-text or padding token) before the token budget; the first
problem's middle is printed whole.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import add_pair_arguments, add_pair_runs, bracketed_runs, load_pair, pair_figures, pair_totals, save


def infill_problems(count: int) -> list[tuple[str, str, str]]:
    """(task id, prefix, suffix) for `count` problems spread over HumanEval (the lab's
    humaneval-infill prompts)."""
    from verispec.errors import VerispecError
    from verispec.lab.prompts import HUMANEVAL_INFILL, load_prompts

    try:
        return [(p.id, p.text, p.suffix) for p in load_prompts(HUMANEVAL_INFILL, count)]
    except VerispecError as exc:
        sys.exit(f"{exc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from verispec.spec.draft_model import DraftModelProposer, pair_vocab_limit

    problems = infill_problems(args.problems)
    target, draft, record = load_pair(args, "filling in the middle",
                                      f"γ = {args.gamma}, up to {args.tokens} tokens, greedy")
    limit = pair_vocab_limit("auto", draft, target)
    drafts = {"draft model": lambda: DraftModelProposer(draft, vocab_limit=limit), "prompt lookup": lambda: "ngram"}
    totals = {name: pair_totals(valid=True) for name in drafts}
    ended = 0
    record.update(gamma=args.gamma, tokens=args.tokens, problems=[p[0] for p in problems], ways={})
    for index, (task, prefix, suffix) in enumerate(problems):
        before, specs, after = bracketed_runs(target, prefix, drafts, index, args.gamma, suffix=suffix,
                                              max_tokens=args.tokens)
        ended += before.finish_reason == "eos"
        if task == problems[0][0]:
            print(f"  {task}'s gap, as the target filled it:\n{before.text}\n  (then the suffix: {suffix!r})")
        for name, spec in specs.items():
            add_pair_runs(totals[name], (before.timings.decode_s + after.timings.decode_s) / 2,
                          len(before.token_ids), spec)
            totals[name]["valid"] &= spec.token_ids == before.token_ids == after.token_ids
        print(f"  {task:>14}: {len(before.token_ids):3d} tokens, {before.finish_reason}; "
              + ", ".join(f"{name} {s.spec.acceptance_rate:.0%} kept" for name, s in specs.items()))
    all_valid = True
    for name, entry in totals.items():
        pair_figures(entry)
        all_valid &= entry["valid"]
        print(f"  {name:>13}: speed-up {entry['speedup']:.2f}x, acceptance {entry['acceptance']:.1%}, "
              f"{'VALID' if entry['valid'] else 'INVALID'}")
    print(f"  {ended}/{len(problems)} middles ended by the model")
    record.update(ways=totals, ended=ended)
    save("infill", record, {"gamma": args.gamma, "problems": len(problems), "all_valid": all_valid,
                            "speedup": {name: round(e["speedup"], 4) for name, e in totals.items()}})
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
