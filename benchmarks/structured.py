"""What holding the output to JSON costs plain and speculative decoding, and what masking the
draft alike gains.

    python benchmarks/structured.py                   # extraction and coding, 3 prompts each
    python benchmarks/structured.py --categories writing --prompts 2 --gamma 4

Each chat prompt is answered as any JSON object (`json_schema=True`, the server's
response_format json_object) and freely. For each prompt: plain decoding held to JSON,
speculative decoding with the draft masked as the target is (the engine's way), with a
draft that ignores the mask and with the masked draft on full masks (the three in turn: each
prompt moves which runs first), plain decoding held to JSON on full masks and again as
first, then plain and speculative decoding of the free answer. Greedy choices mask only the
rows whose argmax the structure refuses; "full masks" runs compute every row's mask, as the
engine did before. Speed-up = plain time per token / speculative time per token of the
same answer; VALID when the speculative tokens equal the plain runs'. "Step" is plain
decoding's time per token, held to JSON (with the shortcut and with full masks) and free:
what the mask costs a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import (add_category_arguments, add_pair_arguments, add_pair_runs, ignoring_rules, in_turns,
                         load_pair, pair_figures, pair_totals, save)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    add_category_arguments(parser, ["extraction", "coding"])
    args = parser.parse_args()

    from verispec.generate import generate
    from verispec.lab.prompts import load_prompts
    from verispec.spec.draft_model import DraftModelProposer, pair_vocab_limit

    target, draft, record = load_pair(args, "structured output", f"γ = {args.gamma}, {args.tokens} tokens, greedy")
    limit = pair_vocab_limit("auto", draft, target)
    drafts = {"masked draft": lambda: DraftModelProposer(draft, vocab_limit=limit),
              "unmasked draft": lambda: ignoring_rules(DraftModelProposer)(draft, vocab_limit=limit)}
    record.update(gamma=args.gamma, tokens=args.tokens, categories={})
    all_valid = True
    for category in args.categories:
        totals = {f"JSON, {kind}": pair_totals(valid=True) for kind in drafts}
        totals["JSON, masked draft, full masks"] = pair_totals(valid=True)
        totals["free, masked draft"] = pair_totals(valid=True)
        steps = {"JSON": [0.0, 0], "JSON, full masks": [0.0, 0], "free": [0.0, 0]}
        parsed = 0
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        for index, prompt in enumerate(prompts):
            options = dict(chat=True, max_tokens=args.tokens, json_schema=True)
            before = generate(target, prompt.text, **options)
            runs = {kind: lambda make=make: generate(target, prompt.text, draft=make(), gamma=args.gamma, **options)
                    for kind, make in drafts.items()}
            runs["masked draft, full masks"] = lambda: on_full_masks(
                target, prompt.text, draft=drafts["masked draft"](), gamma=args.gamma, **options)
            specs = in_turns(runs, index)
            full = on_full_masks(target, prompt.text, **options)
            after = generate(target, prompt.text, **options)
            free = generate(target, prompt.text, chat=True, max_tokens=args.tokens)
            free_spec = generate(target, prompt.text, chat=True, max_tokens=args.tokens,
                                 draft=drafts["masked draft"](), gamma=args.gamma)
            plain_s = (before.timings.decode_s + after.timings.decode_s) / 2
            for kind, spec in specs.items():
                entry = totals[f"JSON, {kind}"]
                add_pair_runs(entry, plain_s, len(before.token_ids), spec)
                entry["valid"] &= spec.token_ids == before.token_ids == after.token_ids == full.token_ids
            add_pair_runs(totals["free, masked draft"], free.timings.decode_s, len(free.token_ids), free_spec)
            totals["free, masked draft"]["valid"] &= free_spec.token_ids == free.token_ids
            steps["JSON"][0] += plain_s
            steps["JSON"][1] += len(before.token_ids) - 1
            steps["JSON, full masks"][0] += full.timings.decode_s
            steps["JSON, full masks"][1] += len(full.token_ids) - 1
            steps["free"][0] += free.timings.decode_s
            steps["free"][1] += len(free.token_ids) - 1
            parsed += _parses(before.text) and before.finish_reason == "eos"
        for name, entry in totals.items():
            pair_figures(entry)
            all_valid &= entry["valid"]
            print(f"  {category:>10} {name:>31}: speed-up {entry['speedup']:.2f}x, acceptance "
                  f"{entry['acceptance']:.1%}, {'VALID' if entry['valid'] else 'INVALID'}")
        step_ms = {name: 1e3 * s / max(1, n) for name, (s, n) in steps.items()}
        print(f"  {category:>10} plain step: held to JSON {step_ms['JSON']:.1f} ms (full masks "
              f"{step_ms['JSON, full masks']:.1f} ms), free {step_ms['free']:.1f} ms; "
              f"{parsed}/{len(prompts)} JSON answers whole and parsed")
        record["categories"][category] = {"ways": totals, "step_ms": step_ms, "parsed": parsed}
    save("structured", record, {"gamma": args.gamma, "prompts": args.prompts, "all_valid": all_valid,
                                "speedup": {c: {n: round(e["speedup"], 4) for n, e in r["ways"].items()}
                                            for c, r in record["categories"].items()}})
    return 0 if all_valid else 1


def on_full_masks(*args, **options):
    """`generate(*args, **options)` with every row's mask computed in full."""
    from verispec.generate import generate

    with full_masks():
        return generate(*args, **options)


@contextmanager
def full_masks():
    """Every row's mask computed in full, greedy or not: the engine before greedy choices
    skipped the rows whose argmax the structure allows."""
    from verispec.structured import StructureState

    apply = StructureState.apply
    StructureState.apply = lambda self, *args, greedy=False, **options: apply(self, *args, **options)
    try:
        yield
    finally:
        StructureState.apply = apply


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
