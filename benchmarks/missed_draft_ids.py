"""Which of the target's tokens a draft limited to its first ids could not have proposed.

    python benchmarks/missed_draft_ids.py                        # 5 prompts of every Spec-Bench category
    python benchmarks/missed_draft_ids.py --prompts 10 --skip 5 --limit 32768
    python benchmarks/missed_draft_ids.py --from results/perf/<host>/missed_draft_ids.json

A draft limited to the first K ids (`--draft-vocab`) may still propose every id of the
context and Markdown's marks. What it can never propose is a token above K that the answer
uses before the prompt or the answer so far has it: each such token ends a round's run of
accepted drafts. This decodes each prompt plainly (greedy, the target alone) and counts, per
category, the answer's tokens above K and those among them first seen there ("missed"); then,
over all categories, how many distinct ids the misses are, how many of them recur in a second
prompt (all that a fixed list of frequent ids, counted elsewhere, could hope to catch), and
what share of them a larger limit would take in. Timing plays no part, so one run on any host
gives the same counts (the kernels give the same tokens everywhere).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import category_prompts, save
from speedup import spec_bench_categories


def answers(target, categories: list[str], prompts: int, skip: int, tokens: int) -> dict[str, list[dict]]:
    """Per category, each prompt's ids and its plain greedy answer's ids."""
    from verispec.generate import encode_prompt, generate

    found = {}
    for category in categories:
        chosen = category_prompts(category, prompts, skip)
        found[category] = [{"prompt_ids": encode_prompt(target.tokenizer, p.text, True),
                            "answer_ids": generate(target, p.text, chat=True, max_tokens=tokens).token_ids}
                           for p in chosen]
        print(f"  decoded {len(chosen)} {category} prompts", flush=True)
    return found


def misses_of(prompt_ids: list[int], answer_ids: list[int], limit: int, standing: set[int]) -> tuple[int, list[int]]:
    """How many answer tokens lie at or above `limit`, and those among them that neither the
    prompt, the answer before them nor the standing ids hold (in answer order)."""
    seen = set(prompt_ids) | standing
    above, missed = 0, []
    for token in answer_ids:
        if token >= limit:
            above += 1
            if token not in seen:
                missed.append(token)
        seen.add(token)
    return above, missed


def summarise(found: dict[str, list[dict]], limit: int, standing: set[int], larger: list[int], decode) -> dict:
    """Per category and over all: tokens, above the limit, missed, the most frequent misses;
    over all also distinct ids, misses whose id another prompt misses too, and larger limits' share."""
    per_category, prompts_missing = {}, collections.defaultdict(set)
    all_missed = collections.Counter()
    for category, rows in found.items():
        counted = collections.Counter()
        tokens = above = 0
        for index, row in enumerate(rows):
            row_above, missed = misses_of(row["prompt_ids"], row["answer_ids"], limit, standing)
            tokens, above = tokens + len(row["answer_ids"]), above + row_above
            counted.update(missed)
            for token in missed:
                prompts_missing[token].add((category, index))
        all_missed.update(counted)
        per_category[category] = {"tokens": tokens, "above": above, "missed": sum(counted.values()),
                                  "most_missed": [[decode(t), n] for t, n in counted.most_common(8)]}
    total_missed = sum(all_missed.values())
    recurring = sum(n for t, n in all_missed.items() if len(prompts_missing[t]) > 1)
    return {"limit": limit, "categories": per_category,
            "tokens": sum(c["tokens"] for c in per_category.values()), "missed": total_missed,
            "distinct": len(all_missed), "recurring": recurring,
            "recurring_ids": [[decode(t), n, len(prompts_missing[t])] for t, n in all_missed.most_common()
                              if len(prompts_missing[t]) > 1],
            "within": {str(k): sum(n for t, n in all_missed.items() if t < k) for k in larger}}


def report(summary: dict) -> None:
    limit = summary["limit"]
    print(f"answer tokens a draft of the first {limit:,} ids, the context's and Markdown's marks could not propose")
    for category, c in summary["categories"].items():
        tokens = max(1, c["tokens"])
        print(f"  {category:>15}: {c['tokens']:>5} tokens, {c['above'] / tokens:.1%} above {limit:,}, "
              f"{c['missed'] / tokens:.1%} missed: {', '.join(repr(text) for text, _ in c['most_missed'])}")
    missed = max(1, summary["missed"])
    print(f"  all: {summary['missed']} missed of {summary['tokens']} tokens "
          f"({summary['missed'] / max(1, summary['tokens']):.1%}), {summary['distinct']} distinct ids; "
          f"{summary['recurring']} ({summary['recurring'] / missed:.0%}) are ids another prompt misses too: "
          f"{', '.join(f'{text!r} ×{n}' for text, n, _ in summary['recurring_ids'][:16])}")
    for k, n in summary["within"].items():
        print(f"  a limit of {int(k):,} would have held {n} of them ({n / missed:.0%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--categories", nargs="+", default=["all"], help="Spec-Bench categories, or all")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per category")
    parser.add_argument("--skip", type=int, default=0, help="leave out each category's first prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=32768)
    parser.add_argument("--larger", type=int, nargs="*", default=[49152, 65536])
    parser.add_argument("--from", dest="source", type=Path,
                        help="count a saved run's answers again (with today's marks), decoding and saving nothing")
    args = parser.parse_args()

    from verispec.loading import load_model
    from verispec.spec.draft_model import markdown_ids

    target = load_model(args.target, weights=args.weights)
    if args.source:
        found = {category: [{key: [int(t) for t in ids.split()] for key, ids in row.items()} for row in rows]
                 for category, rows in json.loads(args.source.read_text())["answers"].items()}
    else:
        categories = spec_bench_categories() if args.categories == ["all"] else args.categories
        skipped = f" after the first {args.skip}" if args.skip else ""
        print(f"missed draft ids: {target.name} ({args.weights}), {args.prompts} prompts per category{skipped}, "
              f"{args.tokens} tokens")
        found = answers(target, categories, args.prompts, args.skip, args.tokens)
    standing = set(markdown_ids(target.tokenizer))
    summary = summarise(found, args.limit, standing, args.larger, lambda t: target.tokenizer.decode([t]))
    report(summary)
    if args.source:
        return 0  # the saved run stays as it was
    record = {"target": args.target, "weights": args.weights, "prompts": args.prompts, "skip": args.skip,
              "tokens": args.tokens, "summary": summary,
              "answers": {category: [{key: " ".join(map(str, ids)) for key, ids in row.items()} for row in rows]
                          for category, rows in found.items()}}  # ids as text: one line per answer
    history = {key: summary[key] for key in ("limit", "tokens", "missed", "distinct", "recurring")}
    save("missed_draft_ids", record, {**history, "prompts": args.prompts, "skip": args.skip})
    return 0


if __name__ == "__main__":
    sys.exit(main())
