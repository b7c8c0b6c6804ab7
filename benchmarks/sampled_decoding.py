"""Sampled decoding as verispec does it against an earlier way, side by side.

    python benchmarks/sampled_decoding.py                       # coding, writing, translation; T = 0.7
    python benchmarks/sampled_decoding.py --categories all --prompts 2
    python benchmarks/sampled_decoding.py --top-p 0.95             # with a nucleus
    python benchmarks/sampled_decoding.py --against torch.multinomial
    python benchmarks/sampled_decoding.py --against numpy-warp --top-k 50
    python benchmarks/sampled_decoding.py --against none --adaptive --gamma 8 --categories all

Every sampled token is drawn from a row of probabilities over the vocabulary (Qwen2.5's has
151,936 ids): each plain step's, each draft step's, and the target's token after each round's
drafts. The earlier ways, each measured against the engine as it is:

- `torch.multinomial`: drawing with torch.multinomial, which draws one exponential per id;
  verispec's `sample` inverts the cumulative sum at one uniform draw instead
  (`benchmarks/overhead.py` times the two on one row).
- `whole-rows` (the default): the warp through torch's operations, on both threads (softmax;
  top-k by torch.topk, top-p by sorting the whole vocabulary), for all γ + 1 rows of a
  verification pass whether or not a rejection leaves them unread; each draft token drawn
  from, and each residual taken over, a row of the whole vocabulary. verispec now computes the
  target's rows one at a time as the drafts are looked at, on one thread (top-p sorting only
  the most probable ids that hold its mass), and the draft's over its own columns (the default
  draft vocabulary's 32,768 ids and the context's).
- `numpy-warp`: the same rows, warped on one thread by NumPy's operations (softmax; top-k by
  np.partition; top-p sorting the ids above a floor found by a comparison over the row), as
  where the CPU kernels are not built; verispec warps them with the kernels' softmax_,
  top_k_ and nucleus_ (`benchmarks/overhead.py` times the two on one row).

For each prompt this runs plain sampled decoding and speculative sampled decoding each way, one
after the other, the ways' order moving from prompt to prompt, and reports time per token as
ratios within the run; the draft's c is its seconds per drafted token over a plain step's. The
ways may draw different tokens from the same seed (each follows the same distribution), so each
way's outputs are audited against the target's distribution as the lab audits sampled runs.
Greedy decoding on the same prompts (unless --no-greedy) gives the c that sampling's is set
against.
"""

from __future__ import annotations

import contextlib
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import add_pair_runs, pair_figures, pair_totals, rotated, sampled_evidence_of, save, verdict
from sampled_audit import load_sampled_pair, sampled_arguments
from verispec.sampling import _warp_with_torch


def multinomial_draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """The draw verispec made before `sample`: torch.multinomial over the (normalised) row."""
    row = weights.detach().reshape(-1).cpu().float()
    return int(torch.multinomial(row / row.sum(), 1, generator=generator))


@contextlib.contextmanager
def drawing_with_multinomial():
    """Within the block, every sampled token of plain steps, drafts and verification is drawn
    by torch.multinomial."""
    import verispec.sampling as sampling
    import verispec.spec.draft_model as draft_model
    import verispec.spec.verifier as verifier

    modules = (sampling, draft_model, verifier)
    saved = [module.sample for module in modules]
    for module in modules:
        module.sample = multinomial_draw
    try:
        yield
    finally:
        for module, function in zip(modules, saved):
            module.sample = function


def warp_with_torch(logits: torch.Tensor, params) -> torch.Tensor:
    """The warp (sampling.probabilities) as torch's operations compute it, every row at once."""
    return _warp_with_torch(logits.float(), params)


def whole_row(probs: torch.Tensor, first: int, extra_ids, vocab: int) -> torch.Tensor:
    """Probabilities over columns (ids 0..first-1, then extra_ids) as a row of the whole
    vocabulary, built with torch's operations."""
    full = torch.zeros(vocab)
    full[:first] = probs[:first]
    if len(extra_ids):
        full[torch.tensor(list(extra_ids))] = probs[first:]
    return full


def verify_over_whole_rows(target_logits, drafts, draft_probs, params, generator):
    """The verifier's earlier way: every row's distribution first, residuals over whole rows."""
    from verispec.sampling import sample
    from verispec.spec.verifier import Verdict

    p = warp_with_torch(target_logits, params).cpu()
    vocab = p.shape[-1]
    for i, draft in enumerate(drafts):
        if draft_probs is None:
            q_row = torch.zeros(vocab)
            q_row[draft] = 1.0
        else:
            q_row = whole_row(draft_probs.rows[i], min(draft_probs.first, vocab), draft_probs.extra_ids, vocab)
        q_d = float(q_row[draft])
        if q_d > 0 and float(torch.rand((), generator=generator)) < min(1.0, float(p[i, draft]) / q_d):
            continue
        residual = (p[i] - q_row).clamp(min=0)
        return Verdict(i, sample(residual if float(residual.sum()) > 0 else p[i], generator), bonus=False)
    return Verdict(len(drafts), sample(p[len(drafts)], generator), bonus=True)


def draw_over_whole_rows(self, probs: torch.Tensor, generator: torch.Generator) -> int:
    """The draft's earlier draw (DraftModelProposer._draw): its columns made a row of the whole
    vocabulary first."""
    from verispec.sampling import sample

    return sample(whole_row(probs, self.vocab_limit, self.extra_ids[:probs.shape[-1] - self.vocab_limit]
                            if self.context_ids else [], self.rows), generator)


@contextlib.contextmanager
def over_whole_rows():
    """Within the block, sampled decoding works the earlier way (`whole-rows` above)."""
    import verispec.generate as engine
    import verispec.sampling as sampling
    import verispec.spec.draft_model as draft_model

    proposer = draft_model.DraftModelProposer
    saved = (sampling.probabilities, draft_model.probabilities, engine.verify_sampling, proposer._draw)
    sampling.probabilities = draft_model.probabilities = warp_with_torch
    engine.verify_sampling, proposer._draw = verify_over_whole_rows, draw_over_whole_rows
    try:
        yield
    finally:
        sampling.probabilities, draft_model.probabilities, engine.verify_sampling, proposer._draw = saved


@contextlib.contextmanager
def warping_with_numpy():
    """Within the block, the CPU warp runs as where the kernels are not built (NumPy's
    operations); every other kernel stays."""
    import verispec.sampling as sampling

    saved = sampling.cpu_kernels
    sampling.cpu_kernels = lambda: None
    try:
        yield
    finally:
        sampling.cpu_kernels = saved


EARLIER_WAYS = {"whole-rows": over_whole_rows, "torch.multinomial": drawing_with_multinomial,
                "numpy-warp": warping_with_numpy}


def compare(target, draft, prompts, ways: dict, gamma: int, tokens: int, warp: dict, seed: int = 0,
            adaptive: bool = False) -> dict:
    """Per way (a name and the context it runs in): plain and speculative seconds and tokens,
    draft seconds and drafts, and the outputs' evidence for the audit (lab.audit.sampled_evidence),
    sampled with `warp` (temperature, top_k, top_p), speculation `adaptive` (γ at most `gamma`)
    or not. The way named "greedy" decodes at temperature 0 instead, its outputs compared token
    for token."""
    from verispec.generate import generate

    totals = {way: pair_totals(outputs=[]) for way in ways}
    for index, prompt in enumerate(prompts):
        for way in rotated(list(ways), index):
            context = ways[way]
            options = {"chat": True, "max_tokens": tokens, **({"temperature": 0.0} if way == "greedy" else warp)}
            with context():
                plain = generate(target, prompt.text, seed=seed + index, **options)
                spec = generate(target, prompt.text, draft=draft, gamma=gamma, seed=seed + index,
                                **({"adaptive": "cost"} if adaptive else {}), **options)
            entry = totals[way]
            add_pair_runs(entry, plain.timings.decode_s, len(plain.token_ids), spec)
            entry["outputs"].append((prompt.text, plain.token_ids, spec.token_ids, seed + index))
    for way, entry in totals.items():  # after every timed run: each audit pass costs a prefill
        outputs = entry.pop("outputs")
        if way == "greedy":
            entry["equal"] = all(plain_ids == spec_ids for _, plain_ids, spec_ids, _ in outputs)
        else:
            entry["evidence"] = []
            for text, plain_ids, spec_ids, run_seed in outputs:
                for ids, drafted_by in ((plain_ids, None), (spec_ids, draft)):
                    entry["evidence"].append(sampled_evidence_of(target, text, ids, run_seed=run_seed,
                                                                 draft=drafted_by, **warp))
        entry["plain_ms_per_token"] = 1e3 * entry["plain_s"] / max(1, entry["plain_steps"])
        entry["spec_ms_per_token"] = 1e3 * entry["spec_s"] / max(1, entry["spec_steps"])
        pair_figures(entry)
    return totals


def audit(category: str, results: dict) -> bool:
    """Audit each way's outputs (sampled: by the target's distribution; greedy: speculative
    equal to plain), print its line, and say whether all passed."""
    from verispec.lab.audit import check_sampled_output, sampled_p_values

    for way, r in results.items():
        if way == "greedy":
            r["valid"], tests = r["equal"], "speculative output equal to plain" if r["equal"] else "outputs differ"
        else:
            evidence = r.pop("evidence")
            r["p_values"], r["valid"] = sampled_p_values(evidence), check_sampled_output(evidence).valid
            tests = ", ".join(f"{name} p = {p:.2g}" for name, p in r["p_values"].items())
        print(f"  {category:>15} {way:>17}: plain {r['plain_ms_per_token']:.1f} ms/token, speculative "
              f"{r['spec_ms_per_token']:.1f} ms/token (speed-up {r['speedup']:.2f}x, acceptance "
              f"{r['acceptance']:.1%}, c = {r['c']:.3f}), {'VALID' if r['valid'] else 'INVALID'} ({tests})")
    return all(r["valid"] for r in results.values())


def main() -> int:
    from verispec.lab.prompts import load_prompts

    def more(parser) -> None:
        parser.add_argument("--against", choices=[*EARLIER_WAYS, "none"], default="whole-rows",
                            help="the earlier way to compare with, or none")
        parser.add_argument("--adaptive", action="store_true",
                            help="speculate with --adaptive (γ at most --gamma): is it ever slower than plain?")
        parser.add_argument("--top-k", type=int, default=0, help="sample from the k most probable tokens only")
        parser.add_argument("--top-p", type=float, default=1.0, help="sample from the nucleus of this mass only")
        parser.add_argument("--no-greedy", action="store_true",
                            help="without greedy decoding on the same prompts (whose c sampling's is set against)")

    args = sampled_arguments(__doc__, more=more)
    ways = {args.against: EARLIER_WAYS[args.against]} if args.against != "none" else {}
    ways["now"] = contextlib.nullcontext
    if not args.no_greedy:
        ways["greedy"] = contextlib.nullcontext
    warp = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    title = "sampled decoding" + (f" now and the {args.against} way" if args.against != "none" else "")
    target, draft, record = load_sampled_pair(args, f"{title} (top-k {args.top_k}, top-p {args.top_p}"
                                              f"{', --adaptive' if args.adaptive else ''})")
    record.update(top_k=args.top_k, top_p=args.top_p, adaptive=args.adaptive)
    all_valid, ratios, never_slower = True, {}, {}
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        results = compare(target, draft, prompts, ways, args.gamma, args.tokens, warp, args.seed, args.adaptive)
        all_valid &= audit(category, results)
        record["categories"][category] = results
        never_slower[category] = results["now"]["speedup"]
        if args.against == "none":
            continue
        old, new = results[args.against], results["now"]
        ratios[category] = {"plain": old["plain_ms_per_token"] / new["plain_ms_per_token"],
                            "speculative": old["spec_ms_per_token"] / new["spec_ms_per_token"],
                            "speedup": new["speedup"] / old["speedup"]}
        greedy = f"; greedy c {results['greedy']['c']:.3f}" if "greedy" in results else ""
        print(f"  {category:>15} now against {args.against}: plain {ratios[category]['plain']:.3f}x, "
              f"speculative {ratios[category]['speculative']:.3f}x as fast, speed-up {new['speedup']:.2f}x "
              f"against {old['speedup']:.2f}x; c {new['c']:.3f} against {old['c']:.3f}{greedy}")
    if args.adaptive:
        worst = min(never_slower, key=never_slower.get)
        print(verdict("5 never slower with --adaptive, sampled", f"worst category {worst}: "
                      f"{never_slower[worst]:.3f}x of plain (>= 0.95)", never_slower[worst] >= 0.95))
    record["against"] = args.against
    warped = "".join(f"_{name}_{value}" for name, value, plain in (("top_k", args.top_k, 0), ("top_p", args.top_p, 1.0))
                     if value != plain)
    save(f"sampled_decoding_{args.against.replace('.', '_')}{warped}{'_adaptive' if args.adaptive else ''}", record,
         {"against": args.against, **warp, "adaptive": args.adaptive, "prompts": args.prompts,
          "all_valid": all_valid, "speed_ratio": ratios, "speedup": never_slower})
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
