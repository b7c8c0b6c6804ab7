"""A draft limited to the first token ids (`draft_vocab`): what it saves and what it costs.

    python benchmarks/draft_vocab.py                          # coding, math_reasoning, translation
    python benchmarks/draft_vocab.py --limits 32768 --gamma 4 --prompts 2
    python benchmarks/draft_vocab.py --limits 32768 --adaptive --categories qa translation coding
    python benchmarks/draft_vocab.py --with-context-only --limits 32768 --categories all
    python benchmarks/draft_vocab.py --with-context-only --limits 32768 --without-markdown --categories coding

The 0.5B draft's output layer (151,936 rows) is 28% of its weights. Limited to the first K
ids, which a byte-level BPE gives to its most frequent tokens, it reads fewer bytes per
draft step; where the target picks a token above K the draft cannot have proposed it, so
acceptance falls. Most such tokens are words of the prompt or of the answer so far, which
`--draft-vocab` lets the draft propose too ("and context", with Markdown's marks, which an
answer uses before its context has them; --without-markdown adds the way without them);
"first K only" is the limit alone. For each prompt this runs plain decoding, speculative
decoding with the whole vocabulary and each limit both ways (in an order that rotates from
prompt to prompt), and plain decoding again, one after the other, so a change in machine
load hits them alike. Speed-up = plain decoding time / speculative decoding time; c = draft
seconds per drafted token / target seconds per plain step.
With --adaptive the speculative runs choose γ as `--adaptive` does (up to --gamma or 16),
seeing the cheaper draft steps. Every speculative run is audited: its tokens must equal the
plain runs' (VALID). With --temperature the runs sample (seed --seed + the prompt's index),
speed-ups compare time per token, and each way's tokens, the plain runs' too, are tested
together against the target's distribution as the audit tests sampled output (any departure,
and a lean towards the draft; see verispec.lab.audit): VALID when neither test refuses them.
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import (add_pair_arguments, add_pair_runs, category_prompts, in_turns, load_pair, pair_figures,
                         pair_totals, sampled_evidence_of, save)
from verispec.lab.audit import check_sampled_output, sampled_p_values
from speedup import spec_bench_categories


def run(target, prompt: str, tokens: int, **options):
    from verispec.generate import generate

    return generate(target, prompt, chat=True, max_tokens=tokens, **options)


def p_values_text(p_values: dict[str, float]) -> str:
    return ", ".join(f"{name} p = {p:.2g}" for name, p in p_values.items())


def ways_of(limits: list[int], alone: bool = True, without_markdown: bool = False) -> dict[str, tuple]:
    """Each way's name, and its (vocabulary limit, whether the context's ids are proposed too,
    whether Markdown's marks are); without `alone`, only the limits with the context's ids."""
    ways = {"whole": (None, False, False)}
    for limit in limits:
        if alone:
            ways[f"{limit} only"] = (limit, False, False)
        if without_markdown:
            ways[f"{limit} and context, no marks"] = (limit, True, False)
        ways[f"{limit} and context"] = (limit, True, True)
    return ways


def compare(target, draft, prompts, ways: dict[str, tuple], gamma: int, tokens: int,
            adaptive: bool = False, temperature: float = 0.0, seed: int = 0) -> dict:
    """Per way (ways_of): plain and speculative seconds and tokens, drafts kept, draft seconds,
    validity; sampled, also the p-values of each way's runs and of the plain runs."""
    from verispec.spec.draft_model import DraftModelProposer

    def speculative(text: str, sampling: dict, limit, context: bool, marks: bool):
        return run(target, text, tokens, gamma=gamma, adaptive="cost" if adaptive else False,
                   draft=DraftModelProposer(draft, vocab_limit=limit, context_ids=context, markdown=marks), **sampling)

    totals = {way: pair_totals(valid=True, evidence=[]) for way in ways}
    plain_evidence = []
    for index, prompt in enumerate(prompts):
        sampling = {"temperature": temperature, "seed": seed + index}
        before = run(target, prompt.text, tokens, **sampling)
        # each way takes each place in turn: none always runs last
        specs = in_turns({way: lambda way=way: speculative(prompt.text, sampling, *ways[way]) for way in ways}, index)
        after = run(target, prompt.text, tokens, **sampling)
        plain_s = (before.timings.decode_s + after.timings.decode_s) / 2
        if temperature > 0:  # after the timed runs: the audit's passes cost as much as a prefill each
            plain_evidence.append(sampled_evidence_of(target, prompt.text, before.token_ids, temperature, seed + index,
                                                      draft))
        for way, spec in specs.items():
            entry = totals[way]
            add_pair_runs(entry, plain_s, len(before.token_ids), spec)
            if temperature > 0:
                entry["evidence"].append(sampled_evidence_of(target, prompt.text, spec.token_ids, temperature,
                                                             seed + index, draft))
            else:
                entry["valid"] &= spec.token_ids == before.token_ids == after.token_ids
    for entry in totals.values():
        evidence = entry.pop("evidence")
        if temperature > 0:
            entry["p_values"], entry["plain_p_values"] = sampled_p_values(evidence), sampled_p_values(plain_evidence)
            entry["valid"] = check_sampled_output(evidence).valid and check_sampled_output(plain_evidence).valid
        pair_figures(entry)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["coding", "math_reasoning", "translation"],
                        help="Spec-Bench categories, or all of them: all")
    parser.add_argument("--limits", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--skip", type=int, default=0, help="leave out each category's first prompts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--adaptive", action="store_true", help="speculative runs with --adaptive (cost-aware γ)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, audited against the target's distribution")
    parser.add_argument("--seed", type=int, default=0, help="the first prompt's seed when sampling")
    parser.add_argument("--with-context-only", action="store_true",
                        help="compare the whole vocabulary with each limit and the context's ids only")
    parser.add_argument("--without-markdown", action="store_true",
                        help="also each limit and the context's ids without Markdown's marks")
    args = parser.parse_args()

    details = f"{'--adaptive, ' if args.adaptive else ''}γ = {args.gamma}, {args.tokens} tokens"
    if args.skip:
        details += f", each category's first {args.skip} prompts left out"
    if args.temperature > 0:
        details += f", sampled at temperature {args.temperature} (seed {args.seed} + prompt)"
    target, draft, record = load_pair(args, "draft vocabulary", details)
    record.update(gamma=args.gamma, tokens=args.tokens, skip=args.skip, adaptive=args.adaptive,
                  temperature=args.temperature, seed=args.seed, categories={})
    ways = ways_of(args.limits, alone=not args.with_context_only, without_markdown=args.without_markdown)
    if args.categories == ["all"]:
        args.categories = spec_bench_categories()
    all_valid, ratios = True, {}
    for category in args.categories:
        prompts = category_prompts(category, args.prompts, args.skip)
        results = compare(target, draft, prompts, ways, args.gamma, args.tokens, args.adaptive,
                          args.temperature, args.seed)
        record["categories"][category] = results
        whole = results["whole"]
        for way, r in results.items():
            all_valid &= r["valid"]
            ratios.setdefault(way, {})[category] = round(r["speedup"] / whole["speedup"], 4)
            gain = "" if way == "whole" else f"  ({r['speedup'] / whole['speedup']:.3f}x the whole vocabulary's)"
            limit, context, marks = ways[way]
            without = "" if marks or not context else ", no marks"
            label = ("whole vocabulary" if limit is None else
                     f"first {limit:,} {'and context' if context else 'only'}{without}")
            audit = (f" ({p_values_text(r['p_values'])}; plain runs {p_values_text(r['plain_p_values'])})"
                     if "p_values" in r else "")
            print(f"  {category:>15} {label:>34}: speed-up {r['speedup']:.2f}x, acceptance {r['acceptance']:.1%}, "
                  f"c = {r['c']:.3f}, {'VALID' if r['valid'] else 'INVALID'}{audit}{gain}")
    history = {"gamma": args.gamma, "adaptive": args.adaptive, "temperature": args.temperature,
               "prompts": args.prompts, "skip": args.skip, "all_valid": all_valid,
               "ratio_to_whole": {way: r for way, r in ratios.items() if way != "whole"}}
    name = "draft_vocab_adaptive" if args.adaptive else "draft_vocab"
    save(name + ("_sampled" if args.temperature > 0 else ""), record, history)
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
