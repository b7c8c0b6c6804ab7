"""What penalties on repeating cost speculative decoding: acceptance and speed-up with and
without them, the output audited against plain decoding with the same penalties.

    python benchmarks/penalties.py                       # coding and writing, 3 prompts each
    python benchmarks/penalties.py --categories coding --prompts 2 --gamma 4

The target's choices are penalised (presence, frequency, repetition: `verispec.penalties`);
the draft proposes from its own unpenalised logits, so every draft of a token the penalties
push down is a likely rejection. For each prompt and setting: plain decoding, speculative
decoding, plain decoding again, one after the other; speed-up = plain time / speculative
time; VALID when the speculative tokens equal both plain runs'.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import add_pair_arguments, add_pair_runs, load_pair, pair_figures, pair_totals, save

SETTINGS = {
    "none": {},
    "presence 0.5": {"presence_penalty": 0.5},
    "frequency 0.5": {"frequency_penalty": 0.5},
    "repetition 1.1": {"repetition_penalty": 1.1},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["coding", "writing"])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from verispec.generate import generate
    from verispec.lab.prompts import load_prompts

    target, draft, record = load_pair(args, "penalties", f"γ = {args.gamma}, {args.tokens} tokens, greedy")
    record.update(gamma=args.gamma, tokens=args.tokens, categories={})
    all_valid = True
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        totals = {name: pair_totals(valid=True, changed=0) for name in SETTINGS}
        for prompt in prompts:
            unpenalised = None
            for name, penalties in SETTINGS.items():
                options = dict(chat=True, max_tokens=args.tokens, **penalties)
                before = generate(target, prompt.text, **options)
                spec = generate(target, prompt.text, draft=draft, gamma=args.gamma, **options)
                after = generate(target, prompt.text, **options)
                entry = totals[name]
                add_pair_runs(entry, (before.timings.decode_s + after.timings.decode_s) / 2, len(before.token_ids),
                              spec)
                entry["valid"] &= spec.token_ids == before.token_ids == after.token_ids
                unpenalised = before.token_ids if name == "none" else unpenalised
                entry["changed"] += before.token_ids != unpenalised
        record["categories"][category] = totals
        for name, entry in totals.items():
            pair_figures(entry)
            all_valid &= entry["valid"]
            print(f"  {category:>10} {name:>15}: speed-up {entry['speedup']:.2f}x, acceptance "
                  f"{entry['acceptance']:.1%}, {entry['changed']}/{len(prompts)} answers changed by the "
                  f"penalties, {'VALID' if entry['valid'] else 'INVALID'}")
    save("penalties", record, {"gamma": args.gamma, "prompts": args.prompts, "all_valid": all_valid,
                               "speedup": {c: {n: round(e["speedup"], 4) for n, e in t.items()}
                                           for c, t in record["categories"].items()}})
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
