"""How well the audit of sampled output tells a lossless sampler from a broken one, on the demo pair.

    python benchmarks/sampled_audit.py                          # coding, writing, translation; T = 0.7
    python benchmarks/sampled_audit.py --categories all --prompts 5 --temperature 1.0
    python benchmarks/sampled_audit.py --lookup                 # prompt lookup drafts instead

Sampled output cannot be compared with the target-only output token for token; the audit
(`verispec.lab.audit`) tests it against the target's distribution instead: each token's
randomised probability integral transform under the target, teacher-forced, must look
uniform (Kolmogorov-Smirnov), and a martingale that grows when the tokens lean towards the
draft's distribution must stay small (Ville's inequality), per run and for a configuration's
runs together; the audit refuses either at p < 5e-5. For each prompt this samples
speculative decoding twice: with verispec's verifier, and with a broken one that keeps every
draft, so that the draft's distribution is emitted where the target's is owed (the kind of
error that makes speculation look fast). The lossless runs should pass; the broken runs show
how many tokens the audit needs, on real models, to see a draft that is close to the target
(coding) or far from it (prose).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import add_pair_arguments, load_pair, sampled_evidence_of, save
from verispec.spec.prompt_lookup import PromptLookupProposer
from speedup import spec_bench_categories


@contextlib.contextmanager
def keeping_every_draft():
    """Decoding, within the block, with a verifier that accepts every draft and adds a token of the
    target's after them: the output then follows the draft's distribution wherever it drafted."""
    from verispec import generate as engine
    from verispec.sampling import next_token
    from verispec.spec.verifier import Verdict

    honest = engine.verify_sampling

    def trusting(logits, drafts, draft_probs, params, generator):
        if not drafts:  # a plain step samples the target as it should
            return honest(logits, drafts, draft_probs, params, generator)
        return Verdict(len(drafts), next_token(logits[len(drafts)], params, generator), bonus=True)

    engine.verify_sampling = trusting
    try:
        yield
    finally:
        engine.verify_sampling = honest


def audit_prompts(target, new_draft, prompts, gamma: int, tokens: int, temperature: float, seed: int = 0) -> dict:
    """Sample each prompt speculatively (seed + its index) with the draft new_draft() gives (a
    loaded model, or a fresh prompt lookup) and test the tokens against the target, the draft as
    the alternative: each test's p-value per run and for all runs together, whether the audit
    refuses them, tokens and the drafts' acceptance."""
    from verispec.generate import generate
    from verispec.lab.audit import check_sampled_output, sampled_p_values

    evidence, accepted, drafted = [], 0, 0
    for index, prompt in enumerate(prompts):
        result = generate(target, prompt.text, chat=True, draft=new_draft(), gamma=gamma, max_tokens=tokens,
                          temperature=temperature, seed=seed + index)
        evidence.append(sampled_evidence_of(target, prompt.text, result.token_ids, temperature, seed + index,
                                            new_draft()))
        accepted, drafted = accepted + result.spec.accepted, drafted + result.spec.drafted
    per_run = [sampled_p_values([e]) for e in evidence]
    return {"tokens": sum(len(e.u) for e in evidence), "acceptance": accepted / max(1, drafted),
            "p_per_run": {name: [p[name] for p in per_run] for name in per_run[0]},
            "p_together": sampled_p_values(evidence),
            "refused": not (check_sampled_output(evidence).valid and all(check_sampled_output(e).valid
                                                                         for e in evidence))}


def sampled_arguments(description: str, lookup_option: bool = False,
                      more: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The arguments of a benchmark of sampled decoding on the pair: Spec-Bench categories (or
    all), prompts per category, γ, tokens, a temperature above 0, the first prompt's seed, with
    `lookup_option` --lookup (prompt lookup drafts in the draft model's place), and those that
    `more` adds."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["coding", "writing", "translation"],
                        help="Spec-Bench categories, or all of them: all")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    if lookup_option:
        parser.add_argument("--lookup", action="store_true", help="prompt lookup drafts instead of the draft model")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be above 0: this measures sampled decoding")
    if args.categories == ["all"]:
        args.categories = spec_bench_categories()
    return args


def load_sampled_pair(args: argparse.Namespace, title: str):
    """The pair, after a header line naming the sampled runs, and the record its runs fill."""
    details = f"γ = {args.gamma}, {args.tokens} tokens, temperature {args.temperature}, {args.prompts} prompts"
    target, draft, record = load_pair(args, title, details)
    record.update(gamma=args.gamma, tokens=args.tokens, temperature=args.temperature, categories={})
    return target, draft, record


def main() -> int:
    from verispec.lab.prompts import load_prompts

    args = sampled_arguments(__doc__, lookup_option=True)
    target, draft, record = load_sampled_pair(args, "sampled-output audit" + (", prompt lookup" if args.lookup else ""))
    new_draft = PromptLookupProposer if args.lookup else (lambda: draft)
    lossless_pass, broken_refused = True, 0
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        results = {"lossless": audit_prompts(target, new_draft, prompts, args.gamma, args.tokens, args.temperature,
                                             args.seed)}
        with keeping_every_draft():
            results["keeps every draft"] = audit_prompts(target, new_draft, prompts, args.gamma, args.tokens,
                                                         args.temperature, args.seed)
        record["categories"][category] = results
        for way, r in results.items():
            if way == "lossless":
                lossless_pass &= not r["refused"]
            else:
                broken_refused += r["refused"]
            tests = "; ".join(f"{name} p per run {', '.join(f'{p:.2g}' for p in r['p_per_run'][name])}, "
                              f"together {r['p_together'][name]:.2g}" for name in r["p_together"])
            print(f"  {category:>15} {way:>17}: {r['tokens']} tokens, acceptance {r['acceptance']:.1%}, {tests}: "
                  f"{'REFUSED' if r['refused'] else 'passed'}")
    print(f"lossless sampling passed in every category: {'yes' if lossless_pass else 'NO'}; "
          f"the broken verifier refused in {broken_refused} of {len(args.categories)} categories")
    save("sampled_audit_lookup" if args.lookup else "sampled_audit", record,
         {"temperature": args.temperature, "prompts": args.prompts, "lossless_pass": lossless_pass,
          "broken_refused": broken_refused, "categories": len(args.categories)})
    return 0 if lossless_pass else 1


if __name__ == "__main__":
    sys.exit(main())
