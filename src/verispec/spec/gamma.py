"""How many tokens to draft each round: fixed, the familiar heuristic, or cost-aware.

The cost-aware policy picks the γ that maximises expected tokens per second,

    E(γ) / (γ·t_draft + t_verify(γ+1)),   E(γ) = (1 - α^(γ+1)) / (1 - α),

from the acceptance α observed so far and the draft and verify times measured
in this very request. γ = 0 is plain decoding; the policy falls back to it
when speculation does not promise at least `margin` more (what the formula leaves
out, the draft's reading and the bookkeeping, comes off any gain), and probes now
and then to notice a change, ever more rarely while it does not pay.

A draft model with --adaptive reads only the recent context (see `generate`), but prompt
lookup sees all of it for nothing: a summary copies phrases of an article the draft never
read. Where lookup finds a continuation, the policy weighs sending it instead of the draft
model's round (or of a plain step) by the same rate, with lookup's own acceptance and no
drafting cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per round when each draft is kept independently with probability α."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma

    def choose(self) -> int:
        return self.gamma

    def update(self, gamma: int, accepted: int, draft_s: float, verify_s: float,
               draft_steps: int | None = None, lookup: bool = False) -> None:
        pass


class HeuristicGamma:
    """+2 after a fully kept round, -1 otherwise, within [low, high] (transformers' schedule)."""

    def __init__(self, start: int = 4, low: int = 1, high: int = 16):
        self.gamma, self.low, self.high = start, low, high

    def choose(self) -> int:
        return self.gamma

    def update(self, gamma: int, accepted: int, draft_s: float, verify_s: float,
               draft_steps: int | None = None, lookup: bool = False) -> None:
        if gamma == 0:
            return
        step = 2 if accepted == gamma else -1
        self.gamma = max(self.low, min(self.high, self.gamma + step))


@dataclass
class CostAwareGamma:
    max_gamma: int = 16
    decay: float = 0.9  # weight of the past in the running estimates
    probe_every: int = 64  # plain rounds before the first probe once speculation was given up
    probe_gamma: int = 2  # also the γ of the first speculative round
    margin: float = 0.05  # speculate only when it promises at least this much more
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # rounds the prior is worth while the drafts do better than it
    fall_weight: float = 4.0  # and while they do worse: one failed probe does not end speculation
    kept: float = 0.0
    rejected: float = 0.0
    draft_step_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)
    plain_rounds: int = 0
    probe_interval: int = 0  # plain rounds until the next probe; doubles after each probe that fails
    lookup_kept: float = 0.0  # prompt lookup's drafts, weighed as the draft model's are
    lookup_rejected: float = 0.0

    @property
    def alpha(self) -> float:
        return self._estimate(self.kept, self.rejected)

    @property
    def lookup_alpha(self) -> float:
        return self._estimate(self.lookup_kept, self.lookup_rejected)

    def _estimate(self, kept: float, rejected: float) -> float:
        """α from the decayed counts and the prior. The prior weighs more against a fall than a
        rise (the larger of the two estimates): a good draft's α rises fast, and one probe that
        keeps nothing leaves α at 0.48, not 0.4, so the cost model, not the luck of a first
        round, decides whether speculating on pays (where a short pass costs little more than
        a step it does; where it is dear it does not)."""
        def with_prior(weight: float) -> float:
            return (kept + self.prior_alpha * weight) / (kept + rejected + weight)
        return max(with_prior(self.prior_weight), with_prior(self.fall_weight))

    def verify_time(self, positions: int) -> float | None:
        """Measured time of a pass over `positions`, interpolated between measured sizes."""
        if positions in self.verify_s:
            return self.verify_s[positions]
        known = sorted(self.verify_s)
        if not known:
            return None
        below = [m for m in known if m < positions]
        above = [m for m in known if m > positions]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (positions - lo) / (hi - lo)
            return self.verify_s[lo] * (1 - w) + self.verify_s[hi] * w
        if below:  # extrapolate: assume cost grows no slower than the last measured slope
            lo = below[-1]
            slope = (self.verify_s[lo] - self.verify_s[below[0]]) / (lo - below[0]) if len(below) > 1 else 0.0
            return self.verify_s[lo] + max(slope, 0.05 * self.verify_s[known[0]]) * (positions - lo)
        return self.verify_s[above[0]]

    def choose(self) -> int:
        if self.draft_step_s is None or 1 not in self.verify_s:
            # measure both costs first: one plain step, then a short speculative round
            return 0 if 1 not in self.verify_s else self.probe_gamma
        best_gamma, best_rate = 0, self._plain_rate()
        for gamma in range(1, self.max_gamma + 1):
            rate = self._draft_rate(gamma)
            if rate > best_rate:
                best_gamma, best_rate = gamma, rate
        if best_gamma == 0:
            # look again now and then (acceptance may change), ever more rarely while it does not pay
            self.plain_rounds += 1
            self.probe_interval = self.probe_interval or self.probe_every
            if self.plain_rounds >= self.probe_interval:
                self.plain_rounds = 0
                self.probe_interval = min(2 * self.probe_interval, 8 * self.probe_every)
                return self.probe_gamma
        else:
            self.plain_rounds, self.probe_interval = 0, 0
        return best_gamma

    def lookup_gamma(self, available: int, gamma: int) -> int:
        """How many of prompt lookup's `available` drafts to send in place of this round's γ
        (the draft model's drafts, or a plain step if 0); 0 keeps the round as it was.
        Lookup costs only the verification's extra positions."""
        if self.draft_step_s is None or 1 not in self.verify_s:
            return 0  # the draft model's costs are measured first
        rate = self._draft_rate(gamma) if gamma else self._plain_rate()
        alpha, best = self.lookup_alpha, 0
        for n in range(1, min(available, self.max_gamma) + 1):
            candidate = expected_tokens(alpha, n) / self.verify_time(n + 1)
            if candidate > rate:
                best, rate = n, candidate
        return best

    def _plain_rate(self) -> float:
        """Tokens a second a round must beat to be worth more than a plain step (by `margin`).
        A pass over more positions costs at least a one-position pass, so the cheapest pass
        seen bounds t(1): plain steps are timed only while decoding plainly, and a slow first
        one would otherwise make speculation look better than it is for good."""
        return (1.0 + self.margin) / min(self.verify_s.values())

    def _draft_rate(self, gamma: int) -> float:
        """Expected tokens a second of a round of γ of the draft model's drafts."""
        cost = gamma * self.draft_step_s + self.verify_time(gamma + 1)
        return expected_tokens(self.alpha, gamma) / cost

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, gamma: int, accepted: int, draft_s: float, verify_s: float,
               draft_steps: int | None = None, lookup: bool = False) -> None:
        """One round: γ drafts that took `draft_steps` draft steps (γ unless given), `accepted`
        kept; with `lookup`, prompt lookup's drafts, which say nothing of the draft model's."""
        self.verify_s[gamma + 1] = self._blend(self.verify_s.get(gamma + 1), verify_s)
        if gamma == 0:
            return
        if lookup:
            self.lookup_kept, self.lookup_rejected = self._observe(self.lookup_kept, self.lookup_rejected,
                                                                   gamma, accepted)
            return
        steps = gamma if draft_steps is None else draft_steps
        if steps > 0:  # a step's cost, not a token's: a first draft that came free says nothing of it
            self.draft_step_s = self._blend(self.draft_step_s, draft_s / steps)
        self.kept, self.rejected = self._observe(self.kept, self.rejected, gamma, accepted)

    def _observe(self, kept: float, rejected: float, gamma: int, accepted: int) -> tuple[float, float]:
        """Decayed counts of kept drafts and of rounds that ended in a rejection, after one round."""
        return self.decay * kept + accepted, self.decay * rejected + (1 if accepted < gamma else 0)


def make_policy(gamma: int, adaptive: bool | str) -> FixedGamma | HeuristicGamma | CostAwareGamma:
    if not adaptive:
        return FixedGamma(gamma)
    if adaptive == "heuristic":
        return HeuristicGamma(start=gamma, high=max(gamma, 16))
    return CostAwareGamma(max_gamma=max(gamma, 16))
