"""Prompt lookup at a fixed γ: how far ahead should a continuation run?

    python benchmarks/lookup_drafts.py             # modelled on recorded answers, on three hosts' pass costs
    python benchmarks/lookup_drafts.py --measure --categories coding summarization writing --prompts 3

Prompt lookup drafts what followed the last earlier occurrence of the context's last few
tokens. A match of one or two tokens is weak evidence: in prose the continuation is wrong
more often than not, and every drafted token makes the target's pass longer. Two ways:

  whole     the continuation up to γ tokens, however short the match (the engine before)
  matched   no further ahead than the occurrence matches the context going back
            (PromptLookupProposer's `bounded_by_match`): a one-token match drafts one token, a
            copy that has run for twenty tokens drafts all γ

Modelled (the default): greedy verification keeps exactly the drafts that agree with the
target's own answer, so replaying lookup on a recorded greedy answer gives every round's
drafts and kept tokens exactly; only time is modelled, a pass over m positions costing t(m)
from a recorded cost table. The answers and tables are `policy_replay.py`'s records (13
Spec-Bench categories x 5 prompts, the 1.5B in int8). The first token comes from the prompt's
pass in both ways and is left out of both, as in the engine's timings.

--measure decodes the prompts for real on this machine: plain, then each way, for every γ,
audited token for token against the plain output (VALID), speed-up = plain decoding time /
lookup decoding time over the same tokens, within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from agreement import common_prefix
from perf_common import RESULTS, save, verdict
from verispec.spec.prompt_lookup import PromptLookupProposer

PERF = RESULTS.parent
ANSWERS = PERF / "intel-6-167" / "policy_replay_int8_auto_vocab.json"
COSTS = {"Xeon with AMX": ANSWERS, "Zen 4": PERF / "amd-25-17" / "policy_replay_int8.json",
         "Zen 1": PERF / "amd-23-1" / "policy_replay_int8_trials_zen1.json"}
WAYS = {"whole": False, "matched": True}


def replay(prompt_ids: list[int], answer: list[int], gamma: int, cost: dict[int, float], ngram: tuple[int, int],
           bounded: bool) -> float:
    """Modelled seconds of decoding `answer` after its first token with prompt lookup."""
    lookup = PromptLookupProposer(*ngram, bounded_by_match=bounded)
    context, done, seconds = prompt_ids + answer[:1], 1, 0.0
    while done < len(answer):
        room = min(gamma, len(answer) - done - 1)
        drafts = lookup.lookup(context, room) if room > 0 else []
        kept = common_prefix(drafts, answer[done:])
        seconds += cost[len(drafts) + 1]
        context += answer[done:done + kept + 1]
        done += kept + 1
    return seconds


def modelled(args) -> dict:
    from verispec.lab.prompts import load_prompts
    from verispec.loading import load_model

    record = json.loads(args.answers.read_text())
    tokenizer = load_model(record["draft"], weights=record["draft_weights"]).tokenizer  # the pair's one tokenizer
    requests = []
    for key, answer in record["answers"].items():
        category, number = key.split("/")
        text = load_prompts(f"spec-bench:{category}", limit=int(number) + 1)[int(number)].text
        requests.append((category, tokenizer.encode_chat([{"role": "user", "content": text}]), answer["tokens"]))
    results = {}
    for host, path in args.costs.items():
        costs = json.loads(path.read_text())["costs"]["target"]
        cost = {int(m): s for m, s in costs.items()}
        print(f"  {host}'s costs ({path.parent.name}/{path.name}): t(m)/t(1) "
              + " ".join(f"{m}:{cost[m] / cost[1]:.2f}" for m in (2, 5, 9, 17)))
        for gamma in args.gammas:
            by_category: dict[str, dict[str, list[float]]] = {}
            for category, prompt_ids, answer in requests:
                totals = by_category.setdefault(category, {way: [0.0, 0.0] for way in WAYS})
                for way, bounded in WAYS.items():
                    totals[way][0] += (len(answer) - 1) * cost[1]
                    totals[way][1] += replay(prompt_ids, answer, gamma, cost, args.ngram, bounded)
            ratios = {way: {c: t[way][0] / t[way][1] for c, t in by_category.items()} for way in WAYS}
            results[f"{host}, γ={gamma}"] = ratios
            print(f"    γ = {gamma:>2}: " + "; ".join(
                f"{way} worst {min(r.values()):.3f}x ({min(r, key=r.get)}), best {max(r.values()):.3f}x "
                f"({max(r, key=r.get)})" for way, r in ratios.items()))
            print("      " + ", ".join(f"{c} {ratios['whole'][c]:.2f}x → {ratios['matched'][c]:.2f}x"
                                       for c in by_category))
    return {"answers": f"{args.answers.parent.name}/{args.answers.name}", "ngram": args.ngram, "modelled": results}


def measured(args) -> dict:
    from verispec.generate import generate
    from verispec.lab.prompts import load_prompts
    from verispec.loading import load_model

    target = load_model(args.target, weights=args.weights)
    generate(target, "def f(x):", max_tokens=8)  # warm-up: layouts, caches
    rows = []
    for category in args.categories:
        for prompt in load_prompts(f"spec-bench:{category}", limit=args.prompts):
            plain = generate(target, prompt.text, chat=True, max_tokens=args.tokens)
            for gamma in args.gammas:
                for way, bounded in WAYS.items():
                    lookup = PromptLookupProposer(*args.ngram, bounded_by_match=bounded)
                    run = generate(target, prompt.text, chat=True, max_tokens=args.tokens, draft=lookup, gamma=gamma)
                    rows.append({"category": category, "gamma": gamma, "way": way, "plain_s": plain.timings.decode_s,
                                 "lookup_s": run.timings.decode_s, "valid": run.token_ids == plain.token_ids,
                                 "drafted": run.spec.drafted, "accepted": run.spec.accepted})
    for category in args.categories:
        for gamma in args.gammas:
            line = []
            for way in WAYS:
                group = [r for r in rows if (r["category"], r["gamma"], r["way"]) == (category, gamma, way)]
                ratio = sum(r["plain_s"] for r in group) / sum(r["lookup_s"] for r in group)
                kept = sum(r["accepted"] for r in group) / max(1, sum(r["drafted"] for r in group))
                valid = "VALID" if all(r["valid"] for r in group) else "INVALID"
                line.append(f"{way} {ratio:.3f}x (kept {kept:.0%}, {valid})")
            print(f"    {category}, γ = {gamma}: " + "; ".join(line))
    return {"target": args.target, "weights": args.weights, "tokens": args.tokens, "measured": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, default=ANSWERS, help="a policy_replay.py record of greedy answers")
    parser.add_argument("--costs", type=Path, nargs="+", default=None,
                        help="policy_replay.py records whose target costs to model with (default: three hosts')")
    parser.add_argument("--gammas", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--ngram", type=int, nargs=2, default=(3, 1), metavar=("MAX", "MIN"))
    parser.add_argument("--measure", action="store_true", help="decode for real on this machine instead")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--categories", nargs="+", default=["coding", "summarization", "writing"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category (--measure)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--save-as", default=None)
    args = parser.parse_args()
    args.ngram = tuple(args.ngram)
    args.costs = COSTS if args.costs is None else {p.parent.name: p for p in args.costs}
    print(f"prompt lookup at a fixed γ, n-grams {args.ngram[0]} to {args.ngram[1]}: the whole continuation "
          f"against no further than the match ({'measured' if args.measure else 'modelled'})")
    record = measured(args) if args.measure else modelled(args)
    save(args.save_as or ("lookup_drafts_measured" if args.measure else "lookup_drafts"), record)
    if args.measure:
        return 0 if all(r["valid"] for r in record["measured"]) else 1
    worst = {way: min(min(r[way].values()) for r in record["modelled"].values()) for way in WAYS}
    print(verdict("prompt lookup bounded by its match, worst category over every host and γ, modelled",
                  f"{worst['matched']:.3f}x plain (the whole continuation: {worst['whole']:.3f}x)", None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
