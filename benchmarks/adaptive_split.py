"""Where --adaptive's time goes, request by request, against plain decoding of the same prompt.

    python benchmarks/adaptive_split.py                                  # summarization, translation, qa
    python benchmarks/adaptive_split.py --categories extraction --prompts 5

--adaptive promises never to be much slower than plain decoding (target 5). When it is, the
loss lies in one of four places, which this script times apart for each request:

    plain      the target's one-position steps while the policy decodes plainly
    verify     the target's passes over γ+1 positions in speculative rounds
    draft      the draft's steps in those rounds
    catch-up   the draft reading context it skipped, before its first round and before probes

and compares them with what the same tokens cost plain decoding (its forward passes, timed
the same way in plain runs of the same prompt just before and after). `gain` is the tokens
the speculative rounds produced times the plain pass, less what those rounds cost (verify +
draft); `steps+` is what the plain steps cost beyond the plain runs' passes; `near` and `far`
are a plain step's mean within 3 steps after a speculative round and elsewhere, against
`pass`, the plain runs' step; the last lines give each variant's near minus far over the
requests that have both. Every --adaptive output must equal the plain output (VALID).

With --variants, each prompt is decoded with --adaptive in several ways between the same two
plain runs, their order moving from prompt to prompt: `current` (the engine as it is),
`draft-only` (the engine without prompt lookup's drafts in the draft model's place:
generate(lookup=False)), and trials the engine does not carry: `draft-first` (prompt lookup
takes a draft model's round only after DRAFT_FIRST rounds of the draft model's own, and never a
probe), `late-probe` (LATE_PROBE plain steps before the first speculative round), `plain-bound`
(a plain step's time bounded by the smallest longer pass's only, not by every size's),
`first-look` (the draft reads only the last FIRST_LOOK positions before drafting until the
target keeps one of its drafts, then the last READY_LAG afresh: a failed probe costs a short
pass), `light-prior` (the policy's prior on α worth one round both ways: after a first round
whose drafts were all rejected, α = 0.3 instead of the engine's 0.48), `heavy-prior` (worth
four both ways, where the engine's is worth two while the drafts do better than the prior and
four while they do worse), `fast-fall` (the engine before: worth two both ways), `short-window`
(the draft reads at most the last SHORT_WINDOW positions when it catches up, not READY_LAG),
`first-draft-apart` (the engine before its catch-up pass gave the first draft too: the pass
reads all but the last token, and the first draft step reads that one on its own),
`confident-probe` (the first speculative round waits for a plain step whose token the target
gave at least CONFIDENT probability), `quick-reprobe` (once speculation is given up, the first
probe comes after QUICK_REPROBE plain steps, not 64, doubling from there), `early-cap` (an
answer's first EARLY_ROUNDS speculative rounds draft at most EARLY_CAP tokens). Trials of
prompt lookup in the draft model's place (the engine's LOOKUP_NGRAM: the last 5 tokens, then 4,
3 and 2): `ngram-3`, `ngram-4` and `ngram-8` (the last 3, 4 or 8 first; `ngram-3` the engine
before), `ngram-3-only` (the last 3 tokens only) and `lookup-by-match` (no more of a
continuation offered than its occurrence matches the context going back).
benchmarks/policy_replay.py replays the same variants on a virtual clock, without the machine's
noise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from contextlib import contextmanager

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import add_pair_arguments, in_turns, load_pair, median, save, verdict
from verispec.spec.prompt_lookup import PromptLookupProposer


class TimedModel:
    """The target's model, with each call's positions and seconds recorded."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, cache, **options):
        started = time.perf_counter()
        out = self.model(ids, cache, **options)
        self.calls.append((ids.shape[1], time.perf_counter() - started))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


class ReadingProposer:
    """A draft model proposer that records how much it reads each time it catches up (the
    engine's statistics time drafting and catch-up: draft_s, catch_up_s)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.catch_ups: list[tuple[int, int]] = []  # (positions behind, positions read)

    def start(self, prompt_ids, max_len, **options):
        self.inner.start(prompt_ids, max_len, **options)

    def lag(self, context):
        return self.inner.lag(context)

    def catch_up(self, context, window):
        behind, offset, length = self.inner.lag(context), self.inner.offset, self.inner.cache.length
        self.inner.catch_up(context, window)
        read = self.inner.cache.length - (length if self.inner.offset == offset else 0)
        self.catch_ups.append((behind, read))

    def propose(self, context, gamma, params, generator):
        return self.inner.propose(context, gamma, params, generator)

    def commit(self, length):
        self.inner.commit(length)


FIRST_LOOK = 8


class FirstLookProposer(ReadingProposer):
    """The `first-look` trial: until the target has kept one of its drafts, the draft reads
    only the last FIRST_LOOK positions of the context; then the last READY_LAG afresh."""

    def __init__(self, inner):
        super().__init__(inner)
        self.kept_any, self.proposed_at = False, 0

    def _narrow(self, context) -> bool:
        """Kept a draft, but has read less than the last READY_LAG positions."""
        from verispec.generate import READY_LAG

        offset = self.inner.offset
        return self.kept_any and offset > 0 and len(context) - offset < READY_LAG

    def lag(self, context):
        return max(self.inner.lag(context), 3 if self._narrow(context) else 0)  # > 2: generate() catches up

    def catch_up(self, context, window):
        if self._narrow(context):  # start over on the last `window` positions
            self.inner.offset = max(0, len(context) - window)
            self.inner.cache.rollback(0)
        super().catch_up(context, window if self.kept_any else FIRST_LOOK)

    def propose(self, context, gamma, params, generator):
        self.proposed_at = len(context)
        return super().propose(context, gamma, params, generator)

    def commit(self, length):
        self.kept_any |= length > self.proposed_at > 0
        self.proposed_at = 0
        super().commit(length)


SHORT_WINDOW = 16


class FirstDraftApartProposer(ReadingProposer):
    """The `first-draft-apart` trial: catching up stops a token short, so the first draft
    step reads the last token in a pass of its own, as the engine did before."""

    def catch_up(self, context, window):
        super().catch_up(context[:-1], window - 1)


class TimedReadingProposer(ReadingProposer):
    """The `probe-budget` trial's proposer: it times each catch-up on generate()'s clock (the
    virtual one in a replay) and leaves the seconds for the policy, which the engine's does not
    see."""

    unread_s = 0.0  # catch-up seconds since the policy's last round

    def catch_up(self, context, window):
        import verispec.generate as generation

        started = generation.time.perf_counter()
        super().catch_up(context, window)
        TimedReadingProposer.unread_s += generation.time.perf_counter() - started


# the trials that draft through a proposer of their own; the rest (and probe-budget) change generate() (policy())
PROPOSERS = {"first-look": FirstLookProposer, "first-draft-apart": FirstDraftApartProposer,
             "probe-budget": TimedReadingProposer, "plain-budget": TimedReadingProposer}
VARIANTS = ["current", "draft-only", "draft-first", "late-probe", "plain-bound", "first-look", "light-prior",
            "short-window", "first-draft-apart", "confident-probe", "quick-reprobe", "heavy-prior",
            "fast-fall", "early-cap", "probe-budget", "plain-budget", "ngram-apart", "ngram-3", "ngram-4",
            "ngram-8", "ngram-3-only", "lookup-by-match"]

DRAFT_FIRST = 4


def draft_first_policy(max_gamma: int):
    """The `draft-first` trial's policy: prompt lookup takes the place of a draft model's round
    only once the draft model has had DRAFT_FIRST rounds of its own, and never of the round
    that follows plain steps (a probe); it may always take a plain step's place."""
    from dataclasses import dataclass

    from verispec.spec.gamma import CostAwareGamma

    @dataclass
    class DraftFirstGamma(CostAwareGamma):
        own_rounds: int = 0
        last_choice: int = 0
        after_plain: bool = True

        def choose(self) -> int:
            self.after_plain = self.last_choice == 0
            self.last_choice = super().choose()
            return self.last_choice

        def lookup_gamma(self, available: int, gamma: int) -> int:
            if gamma and (self.after_plain or self.own_rounds < DRAFT_FIRST):
                return 0
            return super().lookup_gamma(available, gamma)

        def update(self, gamma, accepted, draft_s, verify_s, draft_steps=None, lookup=False):
            self.own_rounds += bool(gamma) and not lookup
            super().update(gamma, accepted, draft_s, verify_s, draft_steps, lookup)

    return DraftFirstGamma(max_gamma=max_gamma)


LATE_PROBE = 8


def late_probe_policy(max_gamma: int):
    """The `late-probe` trial's policy: LATE_PROBE plain steps before the first speculative
    round, so that an answer shorter than that never pays the draft's first reading."""
    from dataclasses import dataclass

    from verispec.spec.gamma import CostAwareGamma

    @dataclass
    class LateProbeGamma(CostAwareGamma):
        steps_before: int = 0

        def choose(self) -> int:
            if self.draft_step_s is None and self.steps_before < LATE_PROBE:
                self.steps_before += 1
                return 0
            return super().choose()

    return LateProbeGamma(max_gamma=max_gamma)


CONFIDENT = 0.8


class Confidence:
    """The probability the target gave its own token in its last round (the `confident-probe`
    trial's sign), read off the logits its verification compares the drafts with."""

    last = 1.0

    @staticmethod
    def recording(verify):
        def verify_and_record(logits, drafts):
            Confidence.last = torch.softmax(logits[-1].float(), dim=-1).max().item()
            return verify(logits, drafts)
        return verify_and_record


def confident_probe_policy(max_gamma: int):
    """The `confident-probe` trial's policy: the first speculative round waits for a plain step
    whose token the target gave at least CONFIDENT probability, on the bet that where the target
    hesitates the draft guesses wrong, and that such answers are the short ones."""
    from verispec.spec.gamma import CostAwareGamma

    class ConfidentProbeGamma(CostAwareGamma):
        def choose(self) -> int:
            if self.draft_step_s is None and 1 in self.verify_s and Confidence.last < CONFIDENT:
                return 0
            return super().choose()

    return ConfidentProbeGamma(max_gamma=max_gamma)


QUICK_REPROBE = 8


def quick_reprobe_policy(max_gamma: int):
    """The `quick-reprobe` trial's policy: once speculation is given up, the next probe comes
    after QUICK_REPROBE plain rounds, not probe_every (64), and the wait doubles from there to
    the engine's longest. One failed first probe then no longer leaves a long answer plain for
    64 steps, and a probe soon after the last costs the draft only a short catch-up."""
    from verispec.spec.gamma import CostAwareGamma

    class QuickReprobeGamma(CostAwareGamma):
        def choose(self) -> int:
            self.probe_interval = self.probe_interval or QUICK_REPROBE  # the first wait, where it would be 64
            return super().choose()

    return QuickReprobeGamma(max_gamma=max_gamma)


EARLY_CAP, EARLY_ROUNDS = 2, 6


def early_cap_policy(max_gamma: int):
    """The `early-cap` trial's policy: the first EARLY_ROUNDS speculative rounds of an answer
    draft at most EARLY_CAP tokens, so that a short answer's few rounds waste little on drafts
    past its first miss, while a long one's later rounds draft as the engine's do."""
    from verispec.spec.gamma import CostAwareGamma

    class EarlyCapGamma(CostAwareGamma):
        spec_rounds: int = 0

        def choose(self) -> int:
            gamma = super().choose()
            if gamma and self.spec_rounds < EARLY_ROUNDS:
                self.spec_rounds += 1
                return min(gamma, EARLY_CAP)
            return gamma

    return EarlyCapGamma(max_gamma=max_gamma)


PROBE_SHARE = 0.1


def probe_budget_policy(max_gamma: int, lookup_waits: bool = True):
    """The `probe-budget` trial's policy: once speculation is given up, the next probe waits
    until the plain steps since the last speculative round have cost what that round lost
    (its catch-up reading, drafts and pass, less the plain steps its tokens saved) over
    PROBE_SHARE, so that failed probes take at most that share of a request's time, and
    probes come soon where they are cheap and late where they are dear. Without
    `lookup_waits` (the `plain-budget` trial) prompt lookup's rounds do not count towards
    the wait: they are rounds of their own, not plain steps the draft model could improve."""
    from verispec.spec.gamma import CostAwareGamma

    class ProbeBudgetGamma(CostAwareGamma):
        plain_s_since: float = 0.0
        last_loss_s: float = 0.0

        def choose(self) -> int:
            gamma = super().choose()
            if self.probe_interval == 0 or self.draft_step_s is None:
                return gamma  # speculating, or measuring the costs
            step = min(self.verify_s.values())
            due = self.plain_s_since >= max(self.last_loss_s, step) / PROBE_SHARE
            self.plain_rounds = 0  # the engine's count of plain rounds plays no part
            return self.probe_gamma if due else 0

        def update(self, gamma, accepted, draft_s, verify_s, draft_steps=None, lookup=False):
            reading_s, TimedReadingProposer.unread_s = TimedReadingProposer.unread_s, 0.0
            super().update(gamma, accepted, draft_s, verify_s, draft_steps, lookup)
            if gamma == 0 or lookup:  # prompt lookup's rounds cost what plain steps do
                self.plain_s_since += verify_s if gamma == 0 or lookup_waits else 0.0
                return
            step = min(self.verify_s.values())
            self.plain_s_since = 0.0
            self.last_loss_s = reading_s + draft_s + verify_s - (accepted + 1) * step

    return ProbeBudgetGamma(max_gamma=max_gamma)


class SizedLookup(PromptLookupProposer):
    """The `ngram-apart` trial's prompt lookup: it notes the size of the n-gram whose
    continuation it found (`matched`, 0 if none), which the trial's policy reads."""

    matched = 0

    def lookup(self, context, gamma):
        found = super().lookup(context, gamma)
        sizes = [n for n in range(self.max_ngram, self.min_ngram - 1, -1)
                 if len(context) > n and tuple(context[-n:]) in self.ends[n]]
        SizedLookup.matched = sizes[0] if found else 0
        return found


def ngram_apart_policy(max_gamma: int):
    """The `ngram-apart` trial's policy: prompt lookup's acceptance learnt apart for each n-gram
    size, so that a 3-gram's continuation can be trusted more than a 2-gram's."""
    from verispec.spec.gamma import CostAwareGamma

    class NgramApartGamma(CostAwareGamma):
        def __init__(self, **options):
            super().__init__(**options)
            self.by_size: dict[int, tuple[float, float]] = {}

        @property
        def lookup_alpha(self) -> float:
            return self._estimate(*self.by_size.get(SizedLookup.matched, (0.0, 0.0)))

        def update(self, gamma, accepted, draft_s, verify_s, draft_steps=None, lookup=False):
            super().update(gamma, accepted, draft_s, verify_s, draft_steps, lookup)
            if lookup:
                n = SizedLookup.matched
                self.by_size[n] = self._observe(*self.by_size.get(n, (0.0, 0.0)), gamma, accepted)

    return NgramApartGamma(max_gamma=max_gamma)


def plain_bound_policy(max_gamma: int):
    """The `plain-bound` trial's policy: a plain step's time is its own estimate, bounded only
    by the smallest longer pass's, not by the least of all sizes' estimates (with noisy
    timings that least is the luckiest, and makes plain decoding look faster than it is)."""
    from verispec.spec.gamma import CostAwareGamma

    class PlainBoundGamma(CostAwareGamma):
        def _plain_rate(self) -> float:
            longer = [m for m in self.verify_s if m > 1]
            step = min(self.verify_s[1], self.verify_s[min(longer)]) if longer else self.verify_s[1]
            return (1.0 + self.margin) / step

    return PlainBoundGamma(max_gamma=max_gamma)


def prior_policy(**prior):
    """A trial of the engine's policy with another prior on α (`prior_weight`, `fall_weight`)."""
    def make(max_gamma: int):
        from verispec.spec.gamma import CostAwareGamma

        return CostAwareGamma(max_gamma=max_gamma, **prior)
    return make


# the trials that change the policy generate() makes, by the largest γ it may choose
POLICIES = {
    "light-prior": prior_policy(prior_weight=1.0, fall_weight=1.0),
    "heavy-prior": prior_policy(prior_weight=4.0),
    "fast-fall": prior_policy(fall_weight=2.0),  # the engine's before
    "draft-first": draft_first_policy,
    "late-probe": late_probe_policy,
    "plain-bound": plain_bound_policy,
    "confident-probe": confident_probe_policy,
    "quick-reprobe": quick_reprobe_policy,
    "early-cap": early_cap_policy,
    "probe-budget": probe_budget_policy,
    "plain-budget": lambda max_gamma: probe_budget_policy(max_gamma, lookup_waits=False),
    "ngram-apart": ngram_apart_policy,
}


# the trials of prompt lookup under --adaptive: what they set in place of generate()'s choice
# (n-gram sizes generate.LOOKUP_NGRAM, (5, 2); the whole continuation, however short the match)
LOOKUP_TRIALS = {"ngram-3": {"max_ngram": 3, "min_ngram": 2}, "ngram-4": {"max_ngram": 4, "min_ngram": 2},
                 "ngram-8": {"max_ngram": 8, "min_ngram": 2}, "ngram-3-only": {"max_ngram": 3, "min_ngram": 3},
                 "lookup-by-match": {"bounded_by_match": True}}


def trial_lookup(trial: dict):
    """Prompt lookup as generate() makes it, with a trial's settings in place of its own."""
    def make(max_ngram: int, min_ngram: int, **settings) -> PromptLookupProposer:
        return PromptLookupProposer(**{"max_ngram": max_ngram, "min_ngram": min_ngram, **settings, **trial})
    return make


@contextmanager
def policy(variant: str):
    """generate() as it is, or with a trial's policy (POLICIES; `confident-probe` also records
    the target's confidence, `ngram-apart` looks up through SizedLookup, the trials
    of LOOKUP_TRIALS with their settings), or the `short-window` trial's window."""
    import verispec.generate as generation

    saved = generation.make_policy, generation.READY_LAG, generation.verify_greedy, generation.PromptLookupProposer
    TimedReadingProposer.unread_s = 0.0
    if variant in POLICIES:
        make = POLICIES[variant]
        generation.make_policy = lambda gamma, adaptive: make(max(gamma, 16))
    if variant == "confident-probe":
        generation.verify_greedy = Confidence.recording(generation.verify_greedy)
        Confidence.last = 1.0
    if variant == "ngram-apart":
        generation.PromptLookupProposer = SizedLookup
    if variant in LOOKUP_TRIALS:
        generation.PromptLookupProposer = trial_lookup(LOOKUP_TRIALS[variant])
    if variant == "short-window":
        generation.READY_LAG = SHORT_WINDOW
    try:
        yield
    finally:
        (generation.make_policy, generation.READY_LAG, generation.verify_greedy,
         generation.PromptLookupProposer) = saved


def timed_run(target, prompt: str, **options):
    """generate(), with the target's forward passes timed: (result, [(positions, seconds)])."""
    from verispec.generate import generate

    timed, original = TimedModel(target.model), target.model
    target.model = timed
    try:
        return generate(target, prompt, chat=True, **options), timed.calls[1:]  # the first call is the prefill
    finally:
        target.model = original


def split(plain_runs: list, run, passes: list, proposer: ReadingProposer) -> dict:
    """One --adaptive request's time, split, against plain runs [(result, passes), ...] of its prompt."""
    plain_s = sum(r.timings.decode_s for r, _ in plain_runs) / len(plain_runs)
    plain_pass_s = sum(s for _, calls in plain_runs for _, s in calls) / sum(len(calls) for _, calls in plain_runs)
    gammas = run.spec.gammas[1:]
    plain_steps = [s for (m, s), g in zip(passes, gammas) if g == 0]
    verify = [s for (m, s), g in zip(passes, gammas) if g > 0]
    spec_tokens = run.spec.accepted + len(verify)  # kept drafts and one target token a round
    record = {
        "prompt_tokens": run.prompt_tokens, "tokens": len(run.token_ids), "plain_s": plain_s,
        "adaptive_s": run.timings.decode_s, "ratio": plain_s / run.timings.decode_s,
        "valid": all(run.token_ids == r.token_ids for r, _ in plain_runs),
        "plain_pass_s": plain_pass_s, "plain_rounds": len(plain_steps), "plain_rounds_s": sum(plain_steps),
        "spec_rounds": len(verify), "verify_s": sum(verify),
        "draft_s": run.spec.draft_s - run.spec.catch_up_s, "drafted": run.spec.drafted, "accepted": run.spec.accepted,
        "spec_tokens": spec_tokens,
        "catch_ups": len(proposer.catch_ups), "catch_up_s": run.spec.catch_up_s,
        "catch_up_read": sum(n for _, n in proposer.catch_ups),
        "lookup_drafted": run.spec.lookup_drafted, "lookup_accepted": run.spec.lookup_accepted,
    }
    record["other_s"] = record["adaptive_s"] - record["plain_rounds_s"] - record["verify_s"] - record["draft_s"] \
        - record["catch_up_s"]
    record["gain_s"] = spec_tokens * plain_pass_s - record["verify_s"] - record["draft_s"]
    record["plain_extra_s"] = record["plain_rounds_s"] - len(plain_steps) * plain_pass_s
    record["near_ms"], record["far_ms"] = (1e3 * s for s in steps_near_and_far(passes, gammas))
    record["verify_ms"] = [round(1e3 * s, 1) for s in verify]
    return record


NEAR = 3  # plain steps this close after a speculative round count as `near` it


def steps_near_and_far(passes: list, gammas: list) -> tuple[float, float]:
    """Mean seconds of the plain steps within NEAR steps after a speculative round, and of the
    others (before the first round, or further from one): does a probe leave steps slower?"""
    near, far, since = [], [], None
    for (_, seconds), gamma in zip(passes, gammas):
        if gamma > 0:
            since = 0
            continue
        (near if since is not None and since < NEAR else far).append(seconds)
        since = None if since is None else since + 1
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return mean(near), mean(far)


def near_minus_far(rows: list[dict]) -> str:
    """Each request's `near` minus `far` (ms), over the requests that have both, summed up."""
    gaps = sorted(gap for gap in (r["near_ms"] - r["far_ms"] for r in rows) if not math.isnan(gap))
    if not gaps:
        return "no request had plain steps both near a speculative round and far from one"
    return (f"a plain step near a speculative round minus one far from it: median {median(gaps):+.1f} ms "
            f"({gaps[0]:+.1f} to {gaps[-1]:+.1f}) over {len(gaps)} requests")


def requests(target, draft, prompt: str, tokens: int, gamma: int, variants: list[str],
             index: int = 0) -> dict[str, dict]:
    """One prompt: plain, --adaptive in each variant (timed apart; in prompt `index`'s turn, see
    perf_common.in_turns), plain again. The draft proposes the vocabulary the engine's draft
    does by default (`draft_vocab="auto"`)."""
    from verispec.generate import make_proposer

    def variant_run(name: str) -> tuple:
        proposer = PROPOSERS.get(name, ReadingProposer)(make_proposer(draft, target))
        with policy(name):
            result, passes = timed_run(target, prompt, max_tokens=tokens, draft=proposer, gamma=gamma,
                                       adaptive="cost", lookup=name != "draft-only")
        return result, passes, proposer

    before = timed_run(target, prompt, max_tokens=tokens)
    runs = in_turns({name: lambda name=name: variant_run(name) for name in variants}, index)
    after = timed_run(target, prompt, max_tokens=tokens)
    return {name: split([before, after], *run) for name, run in runs.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["summarization", "translation", "qa"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=8, help="the γ passed with --adaptive (as speedup.py)")
    parser.add_argument("--variants", nargs="+", default=["current"], choices=VARIANTS)
    parser.add_argument("--out", default="adaptive_split")
    args = parser.parse_args()

    from verispec.lab.prompts import load_prompts

    target, draft, record = load_pair(args, "where --adaptive's time goes", f"{args.tokens} tokens")
    record.update(tokens=args.tokens, variants=args.variants, requests=[])
    ms = lambda s: f"{1e3 * s:6.0f}"  # noqa: E731
    print(f"  {'category':>14} {'variant':>10} {'prompt':>6} {'out':>4} {'ratio':>6} | {'plain':>6} | "
          f"{'steps':>11} {'spec rounds':>12} {'lookup':>7} {'verify':>6} {'draft':>6} {'catch-up':>13} "
          f"{'other':>6} | {'gain':>6} {'steps+':>6} | {'near':>5} {'far':>5} {'pass':>5}  (ms; kept/drafted, "
          f"then prompt lookup's of them; catch-ups x positions read; a plain step's mean near a speculative "
          f"round, far from one, in plain runs)")
    for category in args.categories:
        for index, prompt in enumerate(load_prompts(f"spec-bench:{category}", limit=args.prompts)):
            for name, r in requests(target, draft, prompt.text, args.tokens, args.gamma, args.variants,
                                    index).items():
                r.update(category=category, variant=name)
                record["requests"].append(r)
                print(f"  {category:>14} {name:>10} {r['prompt_tokens']:>6} {r['tokens']:>4} {r['ratio']:>5.2f}x | "
                      f"{ms(r['plain_s'])} | {r['plain_rounds']:>4} {ms(r['plain_rounds_s'])} {r['spec_rounds']:>4} "
                      f"{r['accepted']:>3}/{r['drafted']:<3} {r['lookup_accepted']:>3}/{r['lookup_drafted']:<3} "
                      f"{ms(r['verify_s'])} {ms(r['draft_s'])} "
                      f"{r['catch_ups']:>2}x{r['catch_up_read']:>4} {ms(r['catch_up_s'])} {ms(r['other_s'])} | "
                      f"{ms(r['gain_s'])} {ms(r['plain_extra_s'])} | {r['near_ms']:5.1f} {r['far_ms']:5.1f} "
                      f"{1e3 * r['plain_pass_s']:5.1f}  {'VALID' if r['valid'] else 'INVALID'}")
    for category in args.categories:
        for name in args.variants:
            rows = [r for r in record["requests"] if r["category"] == category and r["variant"] == name]
            plain, adaptive = sum(r["plain_s"] for r in rows), sum(r["adaptive_s"] for r in rows)
            print(verdict(f"--adaptive ({name}), {category}",
                          f"{plain / adaptive:.3f}x of plain over {len(rows)} requests, "
                          f"{'all VALID' if all(r['valid'] for r in rows) else 'some INVALID'}; speculative rounds "
                          f"gained {1e3 * sum(r['gain_s'] for r in rows):.0f} ms, catch-up reading cost "
                          f"{1e3 * sum(r['catch_up_s'] for r in rows):.0f} ms, plain steps "
                          f"{1e3 * sum(r['plain_extra_s'] for r in rows):+.0f} ms against plain decoding's", None))
    for name in args.variants:
        print(f"  {name}: " + near_minus_far([r for r in record["requests"] if r["variant"] == name]))
    save(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
