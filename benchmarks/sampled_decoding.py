"""Sampled decoding with verispec's draw of a token against torch.multinomial's, side by side.

    python benchmarks/sampled_decoding.py                       # coding, writing, translation; T = 0.7
    python benchmarks/sampled_decoding.py --categories all --prompts 2

Every sampled token is drawn from a row of probabilities over the vocabulary (Qwen2.5's has
151,936 ids): each plain step's, each draft step's, and the target's token after each round's
drafts. torch.multinomial draws one exponential per id for it; verispec's `sample` inverts
the cumulative sum at one uniform draw instead (`benchmarks/overhead.py` times the two on one
row). For each prompt this runs plain sampled decoding and speculative sampled decoding with
each way of drawing, one after the other, and reports time per token as ratios within the
run; the draft's c is its seconds per drafted token over a plain step's. The two ways draw
different tokens from the same seed (both follow the same distribution), so each way's
outputs are audited against the target's distribution as the lab audits sampled runs.
"""

from __future__ import annotations

import contextlib
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import add_pair_runs, pair_figures, pair_totals, sampled_evidence_of, save
from sampled_audit import load_sampled_pair, sampled_arguments

WAYS = ("torch.multinomial", "sample")


def multinomial_draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """The draw verispec made before `sample`: torch.multinomial over the (normalised) row."""
    row = weights.detach().reshape(-1).cpu().float()
    return int(torch.multinomial(row / row.sum(), 1, generator=generator))


@contextlib.contextmanager
def drawing_with(way: str):
    """Within the block, every sampled token of plain steps, drafts and verification is drawn `way`."""
    import verispec.sampling as sampling
    import verispec.spec.draft_model as draft_model
    import verispec.spec.verifier as verifier

    modules = (sampling, draft_model, verifier)
    saved = [module.sample for module in modules]
    for module in modules:
        module.sample = multinomial_draw if way == "torch.multinomial" else saved[0]
    try:
        yield
    finally:
        for module, function in zip(modules, saved):
            module.sample = function


def compare(target, draft, prompts, gamma: int, tokens: int, temperature: float, seed: int = 0) -> dict:
    """Per way: plain and speculative seconds and tokens, draft seconds and drafts, and the
    outputs' evidence for the audit (lab.audit.sampled_evidence)."""
    from verispec.generate import generate

    totals = {way: pair_totals(outputs=[]) for way in WAYS}
    options = {"chat": True, "max_tokens": tokens, "temperature": temperature}
    for index, prompt in enumerate(prompts):
        for way in WAYS:
            with drawing_with(way):
                plain = generate(target, prompt.text, seed=seed + index, **options)
                spec = generate(target, prompt.text, draft=draft, gamma=gamma, seed=seed + index, **options)
            entry = totals[way]
            add_pair_runs(entry, plain.timings.decode_s, len(plain.token_ids), spec)
            entry["outputs"].append((prompt.text, plain.token_ids, spec.token_ids, seed + index))
    for entry in totals.values():  # after every timed run: each audit pass costs a prefill
        outputs = entry.pop("outputs")
        entry["evidence"] = []
        for text, plain_ids, spec_ids, run_seed in outputs:
            entry["evidence"].append(sampled_evidence_of(target, text, plain_ids, temperature, run_seed))
            entry["evidence"].append(sampled_evidence_of(target, text, spec_ids, temperature, run_seed, draft))
        entry["plain_ms_per_token"] = 1e3 * entry["plain_s"] / max(1, entry["plain_steps"])
        entry["spec_ms_per_token"] = 1e3 * entry["spec_s"] / max(1, entry["spec_steps"])
        pair_figures(entry)
    return totals


def main() -> int:
    from verispec.lab.audit import check_sampled_output, sampled_p_values
    from verispec.lab.prompts import load_prompts

    args = sampled_arguments(__doc__)

    target, draft, record = load_sampled_pair(args, "sampled decoding by way of drawing")
    all_valid, ratios = True, {}
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        results = compare(target, draft, prompts, args.gamma, args.tokens, args.temperature, args.seed)
        for way, r in results.items():
            evidence = r.pop("evidence")
            r["p_values"], r["valid"] = sampled_p_values(evidence), check_sampled_output(evidence).valid
            all_valid &= r["valid"]
            tests = ", ".join(f"{name} p = {p:.2g}" for name, p in r["p_values"].items())
            print(f"  {category:>15} {way:>17}: plain {r['plain_ms_per_token']:.1f} ms/token, speculative "
                  f"{r['spec_ms_per_token']:.1f} ms/token (speed-up {r['speedup']:.2f}x, acceptance "
                  f"{r['acceptance']:.1%}, c = {r['c']:.3f}), {'VALID' if r['valid'] else 'INVALID'} ({tests})")
        old, new = results["torch.multinomial"], results["sample"]
        ratios[category] = {"plain": old["plain_ms_per_token"] / new["plain_ms_per_token"],
                            "speculative": old["spec_ms_per_token"] / new["spec_ms_per_token"]}
        print(f"  {category:>15} sample against torch.multinomial: plain {ratios[category]['plain']:.3f}x, "
              f"speculative {ratios[category]['speculative']:.3f}x as fast; c {new['c']:.3f} against {old['c']:.3f}")
        record["categories"][category] = results
    save("sampled_decoding", record, {"temperature": args.temperature, "prompts": args.prompts,
                                      "all_valid": all_valid, "speed_ratio": ratios})
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
