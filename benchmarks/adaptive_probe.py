"""What --adaptive's first probe costs, by how much of the context the draft reads before it.

    python benchmarks/adaptive_probe.py                          # coding and translation, 32 / 16 / 8 positions
    python benchmarks/adaptive_probe.py --categories qa --lags 32 8 --prompts 5
    python benchmarks/adaptive_probe.py --draft-side      # the draft's part of a probe, two ways

With --adaptive a draft model reads the context only when it is about to draft, and then no
more than its last READY_LAG positions (verispec.generate). Its first probe therefore costs a
pass of the draft over up to READY_LAG positions and a couple of draft steps: little against a
long answer, several percent of a short one. Reading less makes the probe cheaper but lets the
draft see less of the question. For each prompt: a plain run, one --adaptive run per lag (their
order moving from prompt to prompt), another plain run (load drift hits both sides alike);
every --adaptive output must equal the plain output. Per category and lag: plain seconds /
adaptive seconds, and the drafted and accepted tokens.

With --draft-side, only the draft's part of a first probe (reading the last READY_LAG
positions, then γ = 2 drafts) is timed, on each prompt in turn two ways (which first
alternating from round to round): as the engine does it, the pass that reads the context giving
the first draft too, and `apart`, that pass stopping a token short and the first draft step
reading the last token on its own, as the engine did before. Both must give the same drafts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import add_pair_arguments, in_turns, load_pair, rotated, save, verdict


def draft_side(draft, prompts, rounds: int, lag: int) -> dict:
    """Seconds of the draft's part of a first probe, the first draft from the reading pass
    (`merged`) or from a pass of its own (`apart`), in turn on each prompt."""
    from adaptive_split import FirstDraftApartProposer, ReadingProposer
    from verispec.generate import encode_prompt
    from verispec.sampling import SamplingParams
    from verispec.spec.draft_model import DraftModelProposer

    ways = {"merged": ReadingProposer, "apart": FirstDraftApartProposer}
    times: dict[str, list[float]] = {way: [] for way in ways}
    same = True
    for prompt in prompts:
        context = encode_prompt(draft.tokenizer, prompt.text, True)
        for index in range(rounds):
            drafts = {}
            for way in rotated(list(ways), index):
                kind = ways[way]
                proposer = kind(DraftModelProposer(draft))
                proposer.start(context, len(context) + 8, prefill=False)
                started = time.perf_counter()
                proposer.catch_up(context, lag)
                drafts[way] = proposer.propose(context, 2, SamplingParams(), None).tokens
                times[way].append(time.perf_counter() - started)
            same &= drafts["merged"] == drafts["apart"]
    ratios = [a / m for a, m in zip(times["apart"], times["merged"])]
    return {"merged_ms": 1e3 * statistics.median(times["merged"]), "apart_ms": 1e3 * statistics.median(times["apart"]),
            "ratio": statistics.median(ratios), "pairs": len(ratios), "same_drafts": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["coding", "translation"])
    parser.add_argument("--lags", type=int, nargs="+", default=[32, 16, 8])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=8, help="the largest γ --adaptive may choose (as speedup.py)")
    parser.add_argument("--draft-side", action="store_true", help="time only the draft's part of a probe, two ways")
    parser.add_argument("--rounds", type=int, default=10, help="with --draft-side: rounds per prompt")
    args = parser.parse_args()
    if args.draft_side:
        return draft_side_main(args)

    import verispec.generate as generation
    from verispec.lab.prompts import load_prompts

    target, draft, record = load_pair(args, "--adaptive's first probe", f"{args.tokens} tokens")
    record.update(tokens=args.tokens, default_lag=generation.READY_LAG, categories={})
    for category in args.categories:
        totals = {lag: {"plain_s": 0.0, "adaptive_s": 0.0, "drafted": 0, "accepted": 0, "valid": True}
                  for lag in args.lags}
        for index, prompt in enumerate(load_prompts(f"spec-bench:{category}", limit=args.prompts)):
            before, runs, after = lag_runs(target, draft, prompt.text, args.lags, index, args.gamma,
                                           chat=True, max_tokens=args.tokens)
            plain_s = (before.timings.decode_s + after.timings.decode_s) / 2
            for lag, run in runs.items():
                entry = totals[lag]
                entry["plain_s"] += plain_s
                entry["adaptive_s"] += run.timings.decode_s
                entry["drafted"] += run.spec.drafted
                entry["accepted"] += run.spec.accepted
                entry["valid"] &= run.token_ids == before.token_ids == after.token_ids
        for lag, entry in totals.items():
            entry["ratio"] = entry["plain_s"] / entry["adaptive_s"]
            print(verdict(f"{category}, the draft reading {lag} positions before its first probe",
                          f"{entry['ratio']:.3f}x of plain, {entry['accepted']}/{entry['drafted']} drafts kept, "
                          f"{'VALID' if entry['valid'] else 'INVALID'}", None))
        record["categories"][category] = {str(lag): entry for lag, entry in totals.items()}
    save("adaptive_probe", record)
    return 0


def lag_runs(target, draft, prompt: str, lags: list[int], index: int, gamma: int, **options) -> tuple:
    """One prompt: a plain run, an --adaptive run whose draft reads `lag` positions before its
    first probe for each of `lags` (in prompt `index`'s turn: perf_common.in_turns), another
    plain run. Returns (plain before, {lag: --adaptive run}, plain after)."""
    import verispec.generate as generation

    def run_with(lag: int):
        default, generation.READY_LAG = generation.READY_LAG, lag
        try:
            return generation.generate(target, prompt, draft=draft, gamma=gamma, adaptive="cost", **options)
        finally:
            generation.READY_LAG = default

    before = generation.generate(target, prompt, **options)
    runs = in_turns({lag: lambda lag=lag: run_with(lag) for lag in lags}, index)
    return before, runs, generation.generate(target, prompt, **options)


def draft_side_main(args) -> int:
    import verispec.generate as generation
    from verispec.lab.prompts import load_prompts

    _, draft, record = load_pair(args, "the draft's part of --adaptive's first probe", f"{args.rounds} rounds a prompt")
    record.update(lag=generation.READY_LAG, categories={})
    for category in args.categories:
        prompts = load_prompts(f"spec-bench:{category}", limit=args.prompts)
        r = draft_side(draft, prompts, args.rounds, generation.READY_LAG)
        record["categories"][category] = r
        print(verdict(f"{category}, reading {generation.READY_LAG} positions and drafting 2",
                      f"{r['merged_ms']:.1f} ms with the first draft from the reading pass, {r['apart_ms']:.1f} ms "
                      f"apart (median ratio {r['ratio']:.3f}x over {r['pairs']} pairs), "
                      f"{'the same drafts' if r['same_drafts'] else 'DRAFTS DIFFER'}", r["same_drafts"]))
    save("adaptive_probe_draft_side", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
