"""--adaptive's decisions replayed on a virtual clock, so that policies compare without the machine's noise.

    python benchmarks/policy_replay.py --variants current draft-only draft-first
    python benchmarks/policy_replay.py --weights int4 --categories writing roleplay --prompts 5
    python benchmarks/policy_replay.py --costs results/perf/<host>/policy_replay.json   # the same costs again
    python benchmarks/policy_replay.py --answers results/perf/<host>/policy_replay.json  # and the same answers
    python benchmarks/policy_replay.py --draft-vocab all   # the draft proposing its whole vocabulary

A real --adaptive run mixes the policy's choices with the machine's spells: a plain step of
the same target takes 22 ms in one request and 32 ms in the next, so a few prompts cannot
tell two policies apart. Here the decisions are the engine's own, and only time is modelled:

- the target's passes are replaced by its greedy answer (one plain run of each prompt): a
  pass's logits pick the answer's next token at every position, which is what a greedy
  verification compares the drafts with, so the replay keeps exactly the drafts a real run
  keeps, and its output must equal the answer;
- the draft model runs for real, with the engine's catch-up reading and windows, proposing
  the vocabulary `--draft-vocab` gives it (the engine's default, `auto`, unless a cost table
  read with `--costs` was timed with another: tables before the option timed the whole one);
- time is a virtual clock that the engine reads in place of the real one: a target pass over
  m positions costs t(m) and a draft pass over m positions d(m), from one table measured at
  the start of the run (medians, taken in turns) or read from an earlier run's record.

Every variant meets the same costs, so their ratios to plain decoding (whose steps cost
t(1) each) differ only by what the policy decided. What the clock leaves out is the engine's
own bookkeeping between passes (well under a millisecond a round: overhead.py) and the
spells themselves. The variants are adaptive_split.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from adaptive_split import PROPOSERS, VARIANTS, ReadingProposer, policy
from perf_common import add_pair_arguments, draft_vocabulary, load_pair, save, verdict
from verispec.commands.options import draft_vocab_choice
from speedup import spec_bench_categories

TARGET_POSITIONS = range(1, 18)  # up to γ = 16, the cost-aware policy's largest
DRAFT_POSITIONS = range(1, 34)  # catch-up reads at most READY_LAG (32) positions, a round's feed 1 or 2
CONTEXT = 256  # positions already cached when a pass is timed


class VirtualClock:
    """Stands in for the `time` module in generate(): perf_counter() is the modelled time.
    With `jitter` σ, each pass costs its table's time times e^N(0, σ²), from `seed`."""

    def __init__(self, jitter: float = 0.0, seed: int = 0):
        self.now, self.jitter, self.random = 0.0, jitter, random.Random(seed)

    def perf_counter(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds * (math.exp(self.random.gauss(0.0, self.jitter)) if self.jitter else 1.0)


class ReplayCache:
    def __init__(self):
        self.length = 0

    def rollback(self, length: int) -> None:
        self.length = length


class ReplayTarget:
    """The target's model, replaced by its greedy answer to one prompt: each position's logits
    pick the answer's next token (the end of sequence after it), with the probability the real
    target gave it (`confidences`; one logit raised above the others' zeros). A pass over m
    positions after the prefill moves the clock on by t(m)."""

    def __init__(self, model, prompt_tokens: int, answer: list[int], confidences: list[float], eos: int,
                 vocab: int, cost, clock: VirtualClock):
        self.model, self.prompt_tokens, self.answer, self.eos = model, prompt_tokens, answer, eos
        self.vocab, self.cost, self.clock = vocab, cost, clock
        self.logit = [self.logit_for(p) for p in confidences]

    def logit_for(self, probability: float) -> float:
        """The logit that, beside vocab - 1 zeros, has this probability after a softmax."""
        p = min(max(probability, 1.0 / self.vocab + 1e-6), 1.0 - 1e-7)
        return max(math.log(p / (1.0 - p) * (self.vocab - 1)), 1e-3)

    def new_cache(self, max_len: int) -> ReplayCache:
        return ReplayCache()

    def parameters(self):
        return self.model.parameters()

    def __call__(self, ids: torch.Tensor, cache: ReplayCache, last_only: bool = False, **_) -> torch.Tensor:
        start, m = cache.length, ids.shape[1]
        cache.length += m
        rows = [start + m - 1] if last_only else range(start, start + m)
        logits = torch.zeros(1, len(rows), self.vocab)
        for row, position in enumerate(rows):
            index = position + 1 - self.prompt_tokens  # the answer's token this position predicts
            within = 0 <= index < len(self.answer)
            logits[0, row, self.answer[index] if within else self.eos] = self.logit[index] if within else 30.0
        if start > 0:  # the prefill is not part of decoding's time
            self.clock.spend(self.cost(m))
        return logits


class CostedModel:
    """The draft's model, run for real; each pass moves the clock on by d(m)."""

    def __init__(self, model, cost, clock: VirtualClock):
        self.model, self.cost, self.clock = model, cost, clock

    def __call__(self, ids: torch.Tensor, cache, **options):
        out = self.model(ids, cache, **options)
        self.clock.spend(self.cost(ids.shape[1]))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def measure(model, positions: range, last_only: bool, repeats: int = 5, outputs: int | None = None
            ) -> dict[int, float]:
    """Median seconds of a pass over m positions after CONTEXT cached ones, for each m,
    the sizes taken in turns so that a spell touches them all alike; `outputs`: the logits of
    only the first ids, as a draft with a limited vocabulary computes."""
    limited = {} if outputs is None else {"outputs": outputs}
    cache = model.new_cache(CONTEXT + max(positions) + 1)
    ids = lambda m: (torch.arange(m) % 200 + 50).unsqueeze(0)  # noqa: E731  (ordinary tokens of any vocabulary)
    with torch.inference_mode():
        model(ids(CONTEXT), cache, last_only=True)
        times: dict[int, list[float]] = {m: [] for m in positions}
        for _ in range(repeats + 1):  # the first turn warms up
            for m in positions:
                started = time.perf_counter()
                model(ids(m), cache, last_only=last_only, **limited)
                times[m].append(time.perf_counter() - started)
                cache.rollback(CONTEXT)
    return {m: statistics.median(seconds[1:]) for m, seconds in times.items()}


def cost_of(table: dict[int, float]):
    """t(m) from a table of measured sizes; beyond the largest, growing as between the last two."""
    def cost(m: int) -> float:
        if m in table:
            return table[m]
        top = max(table)
        return table[top] + (table[top] - table[top - 1]) * (m - top)
    return cost


def answer_of(target, prompt: str, tokens: int) -> tuple[list[int], list[float]]:
    """The target's greedy answer, and the probability it gave each token (read in one pass
    over prompt and answer)."""
    import verispec.generate as generation

    answer = generation.generate(target, prompt, chat=True, max_tokens=tokens).token_ids
    ids = generation.encode_prompt(target.tokenizer, prompt, True) + answer
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids]), target.model.new_cache(len(ids)))[0, -len(answer) - 1:-1]
    return answer, torch.softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()


def replay(target, draft, prompt: str, answer: tuple[list[int], list[float]], variant: str, costs: dict,
           tokens: int, gamma: int, jitter: float = 0.0, seed: int = 0, draft_vocab: int | None = None) -> dict:
    """One prompt decoded on the virtual clock: plainly, or with --adaptive as `variant` decides,
    the draft proposing the first `draft_vocab` ids and the context's (None: all of them)."""
    import verispec.generate as generation
    from verispec.generate import generate
    from verispec.spec.draft_model import DraftModelProposer

    if draft is target:
        raise ValueError("the draft must be loaded apart from the target: their models are replaced apart")
    clock = VirtualClock(jitter, seed)
    answer, confidences = answer
    prompt_tokens = len(generation.encode_prompt(target.tokenizer, prompt, True))
    real_target, real_draft, real_time = target.model, draft.model, generation.time
    target.model = ReplayTarget(real_target, prompt_tokens, answer, confidences, min(target.tokenizer.eos_ids),
                                target.config.vocab_size, cost_of(costs["target"]), clock)
    draft.model = CostedModel(real_draft, cost_of(costs["draft"]), clock)
    generation.time = clock
    try:
        if variant == "plain":
            result = generate(target, prompt, chat=True, max_tokens=tokens)
        else:
            with policy(variant):
                proposer = PROPOSERS.get(variant, ReadingProposer)(DraftModelProposer(draft, vocab_limit=draft_vocab))
                result = generate(target, prompt, chat=True, max_tokens=tokens, draft=proposer,
                                  gamma=gamma, adaptive="cost", lookup=variant != "draft-only")
    finally:
        target.model, draft.model, generation.time = real_target, real_draft, real_time
    spec = result.spec
    count = lambda name: getattr(spec, name) if spec else 0  # noqa: E731  (a plain run has no statistics)
    return {"decode_s": result.timings.decode_s, "tokens": len(result.token_ids),
            "valid": result.token_ids == answer,
            "plain_steps": spec.gammas[1:].count(0) if spec else len(result.token_ids) - 1,
            "spec_rounds": sum(1 for g in spec.gammas[1:] if g) if spec else 0,
            **{name: count(name) for name in ("drafted", "accepted", "lookup_drafted", "lookup_accepted",
                                              "catch_up_s")}}


def known_answers(path: Path, record: dict, tokens: int) -> dict[str, tuple[list[int], list[float]]]:
    """The answers an earlier record holds, by "category/prompt", if its target, weights and
    token budget are this run's (an answer to other settings would replay a different output)."""
    saved = json.loads(path.read_text())
    settings = {"target": record["target"], "weights": record["weights"], "tokens": tokens}
    differ = {name: saved.get(name) for name, value in settings.items() if saved.get(name) != value}
    if differ or "answers" not in saved:
        sys.exit(f"policy_replay: {path} holds no answers for this run's settings "
                 f"({', '.join(f'{n} {v!r}' for n, v in differ.items()) or 'no answers saved'})")
    print(f"  answers from {path}")
    return {key: (a["tokens"], a["confidences"]) for key, a in saved["answers"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", help="Spec-Bench categories (default: all)")
    parser.add_argument("--prompts", type=int, default=5, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=8, help="the γ passed with --adaptive (as speedup.py)")
    parser.add_argument("--variants", nargs="+", default=["current", "draft-only"], choices=VARIANTS)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="σ of each pass's cost around the table's, log-normal (0.15: most within ±15%%)")
    parser.add_argument("--seeds", type=int, default=1, help="replays of each prompt, with jitter drawn afresh")
    parser.add_argument("--costs", type=Path, help="a record of this script whose cost table to use again")
    parser.add_argument("--answers", type=Path,
                        help="a record of this script whose target answers to use again (the same target, "
                             "weights and token budget), instead of decoding each prompt first")
    parser.add_argument("--draft-vocab", type=draft_vocab_choice, default=argparse.SUPPRESS, metavar="N",
                        help="the draft's first ids it proposes with the context's: N, auto or all (default: "
                             "the vocabulary the --costs table was timed with, else auto, as the engine)")
    parser.add_argument("--out", default="policy_replay")
    args = parser.parse_args()

    from verispec.lab.prompts import load_prompts
    from verispec.spec.draft_model import pair_vocab_limit

    target, draft, record = load_pair(args, "--adaptive replayed on a virtual clock", f"{args.tokens} tokens")
    saved = json.loads(args.costs.read_text()) if args.costs else {}
    timed_with = saved.get("draft_vocab")  # a table from before the option was timed with the whole vocabulary
    choice = getattr(args, "draft_vocab", timed_with if args.costs else "auto")
    vocab = pair_vocab_limit(choice, draft, target)
    if args.costs and vocab != timed_with:
        raise SystemExit(f"{args.costs}'s draft costs were timed with {draft_vocabulary(timed_with)}, not "
                         f"{draft_vocabulary(vocab)}: leave out --draft-vocab, or --costs to time the draft afresh")
    print(f"  the draft proposes {draft_vocabulary(vocab)}")
    if args.costs:
        costs = {side: {int(m): s for m, s in table.items()} for side, table in saved["costs"].items()}
        print(f"  costs from {args.costs}")
    else:
        costs = {"target": measure(target.model, TARGET_POSITIONS, last_only=False),
                 "draft": measure(draft.model, DRAFT_POSITIONS, last_only=True, outputs=vocab)}
    t1 = costs["target"][1]
    print("  target t(m)/t(1): " + " ".join(f"{m}:{costs['target'][m] / t1:.2f}" for m in (2, 3, 5, 9, 17))
          + f"; t(1) {1e3 * t1:.1f} ms; draft d(m)/t(1): "
          + " ".join(f"{m}:{costs['draft'][m] / t1:.2f}" for m in (1, 2, 8, 16, 32)))
    known = known_answers(args.answers, record, args.tokens) if args.answers else {}
    record.update(tokens=args.tokens, gamma=args.gamma, variants=args.variants, jitter=args.jitter,
                  seeds=args.seeds, draft_vocab=vocab, costs=costs, requests=[], answers={})
    print(f"  {'category':>14} {'variant':>11} {'#':>2} {'out':>4} {'ratio':>6} | {'steps':>5} {'rounds':>6} "
          f"{'kept':>7} {'lookup':>7} {'catch-up':>8}  (plain steps; speculative rounds; kept/drafted, then "
          f"prompt lookup's of them; catch-up ms)")
    args.categories = args.categories or spec_bench_categories()
    for category in args.categories:
        for number, prompt in enumerate(load_prompts(f"spec-bench:{category}", limit=args.prompts)):
            key = f"{category}/{number}"
            answer = known[key] if key in known else answer_of(target, prompt.text, args.tokens)
            record["answers"][key] = {"tokens": answer[0], "confidences": answer[1]}
            for seed, name in ((seed, name) for seed in range(args.seeds) for name in args.variants):
                plain = replay(target, draft, prompt.text, answer, "plain", costs, args.tokens, args.gamma,
                               args.jitter, 2 * seed)
                r = replay(target, draft, prompt.text, answer, name, costs, args.tokens, args.gamma,
                           args.jitter, 2 * seed + 1, vocab)
                r.update(category=category, variant=name, prompt=number, seed=seed, plain_s=plain["decode_s"],
                         ratio=plain["decode_s"] / r["decode_s"] if r["decode_s"] > 0 else 1.0)
                record["requests"].append(r)
                print(f"  {category:>14} {name:>11} {number:>2} {r['tokens']:>4} {r['ratio']:>5.2f}x | "
                      f"{r['plain_steps']:>5} {r['spec_rounds']:>6} {r['accepted']:>3}/{r['drafted']:<3} "
                      f"{r['lookup_accepted']:>3}/{r['lookup_drafted']:<3} {1e3 * r['catch_up_s']:>8.0f}  "
                      f"{'VALID' if r['valid'] else 'INVALID'}")
    worst: dict[str, float] = {}
    for name in args.variants:
        for category in args.categories:
            rows = [r for r in record["requests"] if r["category"] == category and r["variant"] == name]
            ratio = sum(r["plain_s"] for r in rows) / sum(r["decode_s"] for r in rows)
            worst[name] = min(worst.get(name, ratio), ratio)
            by_seed = sorted(sum(r["plain_s"] for r in rows if r["seed"] == seed)
                             / sum(r["decode_s"] for r in rows if r["seed"] == seed) for seed in range(args.seeds))
            spread = f" (one replay each: {by_seed[0]:.3f}x to {by_seed[-1]:.3f}x)" if args.seeds > 1 else ""
            print(verdict(f"--adaptive ({name}), {category}", f"{ratio:.3f}x of plain, modelled, over {len(rows)} "
                          f"requests{spread}, {'all VALID' if all(r['valid'] for r in rows) else 'some INVALID'}",
                          None))
    for name in args.variants:
        print(f"  {name}: worst category {worst[name]:.3f}x of plain (modelled)")
    save(args.out, record)
    return 0 if all(r["valid"] for r in record["requests"]) else 1


if __name__ == "__main__":
    sys.exit(main())
