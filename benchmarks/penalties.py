"""What penalties on repeating and a logit bias cost speculative decoding: acceptance and
speed-up with and without them, the output audited against plain decoding with the same ones.

    python benchmarks/penalties.py                       # coding and writing, 3 prompts each
    python benchmarks/penalties.py --categories coding --prompts 2 --gamma 4
    python benchmarks/penalties.py --settings none "no code fences"

The target's choices are penalised (presence, frequency, repetition: `verispec.penalties`; "no
code fences" biases every token holding ``` by -100, so Markdown fences never appear), and so
are the draft's, so that it proposes what the penalised target would pick. Against that, a
draft that ignores the penalties: every draft of a token they push down is a likely rejection.
For each prompt and setting: plain decoding, speculative decoding with the penalised draft and
with the unpenalised one (in turn: each prompt swaps which runs first), plain decoding again,
one after the other; speed-up = plain time / speculative time; VALID when the speculative
tokens equal both plain runs'.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import (add_category_arguments, add_pair_arguments, add_pair_runs, bracketed_runs, ignoring_rules,
                         load_pair, pair_figures, pair_totals, save)

SETTINGS = {
    "none": {},
    "presence 0.5": {"presence_penalty": 0.5},
    "frequency 0.5": {"frequency_penalty": 0.5},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "no code fences": {},  # its logit_bias depends on the tokenizer: see fence_ban
}


def fence_ban(tokenizer) -> dict[int, float]:
    """-100 on every token whose text holds a Markdown code fence."""
    return {i: -100.0 for i in range(tokenizer.vocab_size) if b"```" in tokenizer.token_bytes(i)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    add_category_arguments(parser, ["coding", "writing"])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="which to run; 'none' (the answers the others change) always runs")
    args = parser.parse_args()

    from verispec.lab.prompts import load_prompts
    from verispec.spec.draft_model import DraftModelProposer, pair_vocab_limit

    target, draft, record = load_pair(args, "penalties", f"γ = {args.gamma}, {args.tokens} tokens, greedy")
    limit = pair_vocab_limit("auto", draft, target)
    settings = {name: dict(options) for name, options in SETTINGS.items() if name == "none" or name in args.settings}
    if "no code fences" in settings:
        settings["no code fences"]["logit_bias"] = fence_ban(target.tokenizer)
        banned = sorted(settings["no code fences"]["logit_bias"])
        print(f"  no code fences: token ids {banned} biased by -100 (the draft proposes ids below {limit} "
              f"and the context's)")
    record.update(gamma=args.gamma, tokens=args.tokens, categories={}, settings=list(settings))
    drafts = {"penalised draft": lambda: DraftModelProposer(draft, vocab_limit=limit),
              "unpenalised draft": lambda: ignoring_rules(DraftModelProposer)(draft, vocab_limit=limit)}
    all_valid = True
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        totals = {f"{name}, {kind}": pair_totals(valid=True, changed=0) for name in settings for kind in drafts}
        for index, prompt in enumerate(prompts):
            unpenalised_answer = None
            for name, penalties in settings.items():
                before, specs, after = bracketed_runs(target, prompt.text, drafts, index, args.gamma, chat=True,
                                                      max_tokens=args.tokens, **penalties)
                unpenalised_answer = before.token_ids if name == "none" else unpenalised_answer
                for kind, spec in specs.items():
                    entry = totals[f"{name}, {kind}"]
                    add_pair_runs(entry, (before.timings.decode_s + after.timings.decode_s) / 2,
                                  len(before.token_ids), spec)
                    entry["valid"] &= spec.token_ids == before.token_ids == after.token_ids
                    entry["changed"] += before.token_ids != unpenalised_answer
        record["categories"][category] = totals
        for name, entry in totals.items():
            pair_figures(entry)
            all_valid &= entry["valid"]
            print(f"  {category:>10} {name:>34}: speed-up {entry['speedup']:.2f}x, acceptance "
                  f"{entry['acceptance']:.1%}, {entry['changed']}/{len(prompts)} answers changed by the "
                  f"penalties, {'VALID' if entry['valid'] else 'INVALID'}")
    save("penalties", record, {"gamma": args.gamma, "prompts": args.prompts, "all_valid": all_valid,
                               "speedup": {c: {n: round(e["speedup"], 4) for n, e in t.items()}
                                           for c, t in record["categories"].items()}})
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
