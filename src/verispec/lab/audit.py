"""Audits: a speculative result counts only if it passes three checks.

output      under greedy decoding the speculative output equals the target's own,
            token for token. The one excuse is a numerical tie: a pass over several
            positions may round differently from a single-position step, so where the
            target's top two logits at the first differing position are within float
            tolerance, the run is VALID (tie) and the margin is kept. Sampled output
            must look drawn from the target's distribution: its tokens' randomised
            probability integral transforms, under the target, must pass a test of
            uniformity (see "sampled output" below).
accounting  tokens = accepted + recovered + bonus + plain (the tokens of passes that
            checked no drafts), and target passes = rounds.
physics     a target pass keeps at most the drafts it accepts plus one token of its own
            and costs at least one plain step, so the speed-up cannot exceed
            1 + γ·acceptance; nor can a token take less time than reading the bytes one
            pass must read at the machine's bandwidth, shared by the tokens of a pass.

The physics rules flag only what is impossible: byte counts are lower bounds (a
mixture-of-experts pass reads at least the active experts), and measured ratios
may exceed a bound by `slack` (timing noise) before they are called impossible.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from verispec.errors import VerispecError
from verispec.lab.records import read_text

VALID = "VALID"
TIE = "VALID (tie)"
INVALID = "INVALID"
IMPOSSIBLE = "IMPOSSIBLE"
_SEVERITY = {VALID: 0, TIE: 1, INVALID: 2, IMPOSSIBLE: 3}

DEFAULT_SLACK = 0.10  # how far a measured ratio may exceed a physical bound before it is impossible
# relative tolerance of a logit tie, by the dtype the target computes in (times the top logit's size);
# float32 passes over 1 and many positions differ by ~2e-6 of the top logit on this project's CPUs
_TIE_RTOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}

REQUIRED_COLUMNS = ("baseline_tok_s", "spec_tok_s", "gamma", "acceptance")


@dataclass
class Verdict:
    status: str = VALID
    reason: str = ""
    margin: float | None = None  # top-two logit gap at the first difference, when there is one

    @property
    def valid(self) -> bool:
        return self.status in (VALID, TIE)

    @property
    def severity(self) -> int:
        return _SEVERITY[self.status]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Verdict":
        data = data or {}
        return cls(data.get("status", VALID), data.get("reason", ""), data.get("margin"))


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe status, with the reasons of every verdict of that status (all of them when all pass)."""
    verdicts = list(verdicts)
    if not verdicts:
        return Verdict(VALID, "nothing to check")
    severity = max(v.severity for v in verdicts)
    chosen = [v for v in verdicts if v.severity == severity or (severity <= _SEVERITY[TIE])]
    status = next(v.status for v in verdicts if v.severity == severity)
    margins = [v.margin for v in chosen if v.margin is not None]
    return Verdict(status, "; ".join(v.reason for v in chosen if v.reason), min(margins) if margins else None)


# ---------------------------------------------------------------- output


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (or where the shorter ends); None when identical."""
    for index, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return index
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_output(baseline_ids: Sequence[int], spec_ids: Sequence[int],
                 margin_at: Callable[[int], tuple[float, float]] | None = None) -> Verdict:
    """Speculative output against the target alone; `margin_at(i)` gives (top-two gap, tolerance) at token i."""
    at = first_difference(baseline_ids, spec_ids)
    if at is None:
        return Verdict(VALID, f"output identical to the target alone ({len(spec_ids)} tokens)")
    where = (f"differs from the target alone at token {at} "
             f"({_token_at(baseline_ids, at)} alone vs {_token_at(spec_ids, at)} speculative)")
    if margin_at is None:
        return Verdict(INVALID, where)
    margin, tolerance = margin_at(at)
    if margin <= tolerance:
        return Verdict(TIE, f"{where}, where the target's top two logits are {margin:.2g} apart: "
                            f"a tie within float tolerance {tolerance:.2g}", margin)
    return Verdict(INVALID, f"{where}; the target's top two logits there are {margin:.3g} apart, "
                            f"beyond float tolerance {tolerance:.2g}", margin)


def _token_at(ids: Sequence[int], index: int) -> str:
    return f"id {ids[index]}" if index < len(ids) else "end"


def logit_margin(target, prompt_ids: Sequence[int], prefix: Sequence[int], allowed=None) -> tuple[float, float]:
    """(gap between the target's top two logits after prompt + prefix, the float tolerance for a tie);
    with `allowed` ([vocab] booleans, a structure's mask there), among the ids it allows."""
    import torch

    ids = [*prompt_ids, *prefix]
    with torch.inference_mode():
        cache = target.model.new_cache(len(ids))
        logits = target.model(torch.tensor([ids], device=target.device), cache, last_only=True)[0, -1]
    if allowed is not None:
        logits = held_to(logits[None], allowed[None])[0]
    top = torch.topk(logits.float(), 2).values
    dtype = str(target.dtype).removeprefix("torch.")
    tolerance = _TIE_RTOL.get(dtype, _TIE_RTOL["float32"]) * max(1.0, abs(float(top[0])))
    return float(top[0] - top[1]), tolerance


def held_to(logits, allowed):
    """Logits [rows, width] with every id that `allowed` ([rows, vocab] booleans) refuses at -inf;
    columns past the vocabulary (a padded embedding) are refused, a narrower row is cut."""
    import torch

    width = logits.shape[-1]
    if allowed.shape[-1] >= width:
        allowed = allowed[:, :width]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]))
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def check_structure(tokens: Sequence[int], allowed, ended: bool, end_ids: Iterable[int],
                    description: str) -> Verdict:
    """An output held to a structure: every token among the ids its mask allowed there
    (`allowed` [len(tokens) + 1, vocab]: row i after tokens[:i]), and an output that `ended`
    itself ended where the structure may."""
    import torch

    if tokens:
        kept = allowed[torch.arange(len(tokens)), torch.tensor(list(tokens))]
        if not bool(kept.all()):
            at = int((~kept).nonzero()[0, 0])
            return Verdict(INVALID, f"token {at} ({_token_at(tokens, at)}) leaves {description}")
    ends = [i for i in end_ids if i < allowed.shape[-1]]
    if ended and not bool(allowed[len(tokens), ends].any()):
        return Verdict(INVALID, f"the output ended before {description} was complete")
    return Verdict(VALID, f"held to {description}")


# ---------------------------------------------------------------- sampled output
#
# Sampled output cannot be compared token for token, but it can be checked against the
# distribution it must follow, in two ways, each at half the audit's significance level:
#
# - Any departure. Rank the vocabulary by the target's probability at each position; the
#   randomised probability integral transform u = P(tokens ranked above x) + V·p(x), with V
#   uniform on [0, 1), is uniform on [0, 1) and independent of every earlier u exactly when x
#   was drawn from the target's distribution given the tokens before it. Tokens drawn from
#   another distribution pile up on one side, which a Kolmogorov-Smirnov test sees.
# - A lean towards the draft, the way a broken verifier errs. With q the draft's distribution
#   at each position (a draft model's, or all on the token prompt lookup finds), the product
#   over tokens of ((1 - w)·p(x) + w·q(x)) / p(x) is a nonnegative martingale of mean 1 when
#   the tokens follow p, for every weight w: so is the mean of the products over a few
#   weights, and by Ville's inequality it exceeds 1/α with probability at most α, at any
#   number of tokens. Tokens that lean towards q make it grow geometrically, far faster than
#   the KS test gains power.

SAMPLED_ALPHA = 1e-4  # a sampled output is refused when the target's distribution makes it this improbable
DRAFT_WEIGHTS = (0.25, 0.5, 1.0)  # the weights w of the draft in the martingales' alternatives


def model_probabilities(loaded, prompt_ids: Sequence[int], output_ids: Sequence[int], params,
                        chunk: int = 64, allowed=None):
    """[len(output_ids), vocab]: a model's warped distribution (sampling.probabilities) at each
    output token, given the prompt and the output before it, in passes of at most `chunk` tokens;
    with `allowed` ([len(output_ids), vocab] booleans, a structure's masks), among the ids each
    position allows."""
    import torch

    from verispec.sampling import probabilities

    if not output_ids:
        return torch.zeros(0, 0)
    model, device = loaded.model, loaded.device
    rows = []
    with torch.inference_mode():
        cache = model.new_cache(len(prompt_ids) + len(output_ids))
        rows.append(model(torch.tensor([list(prompt_ids)], device=device), cache, last_only=True)[0])
        inputs = list(output_ids[:-1])
        for start in range(0, len(inputs), chunk):
            rows.append(model(torch.tensor([inputs[start:start + chunk]], device=device), cache)[0])
        logits = torch.cat(rows).float().cpu()
        return probabilities(logits if allowed is None else held_to(logits, allowed), params)


def randomized_pit(probs, tokens: Sequence[int], generator) -> tuple[list[float], int]:
    """(u for each token, how many tokens the distribution gives probability 0).

    `probs` [len(tokens), vocab]; tokens of equal probability are ranked by id, so the
    ranking is fixed before the token is seen, as the transform requires."""
    import torch

    x = torch.tensor(list(tokens), dtype=torch.long)[:, None]
    px = probs.gather(1, x)
    ids = torch.arange(probs.shape[1])[None, :]
    above = (probs > px) | ((probs == px) & (ids < x))
    before = (probs * above).sum(1, keepdim=True)
    u = (before + torch.rand(px.shape, generator=generator) * px).clamp(0.0, 1.0)
    return u[:, 0].tolist(), int((px == 0).sum())


def draft_lean_logs(p, q, tokens: Sequence[int]) -> list[float]:
    """For each weight w of DRAFT_WEIGHTS, log of the product over tokens of ((1 - w)·p + w·q) / p at
    the token: p the target's [len(tokens), vocab], q the draft's (its vocabulary cut or padded to
    the target's; a sub-distribution keeps the martingale's mean at most 1). Tokens the target
    gives probability 0 are left out: randomized_pit counts them."""
    import torch

    from verispec.spec.verifier import on_target_vocab

    q = on_target_vocab(q, p.shape[1])
    x = torch.tensor(list(tokens), dtype=torch.long)[:, None]
    return lean_logs(p.gather(1, x)[:, 0], q.gather(1, x)[:, 0])


def lookup_lean_logs(p, lookup, prompt_ids: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """draft_lean_logs for prompt lookup (a PromptLookupProposer), whose draft is the one token
    its n-grams find after the context so far: q is all on that token, or the target's own p
    where lookup finds none (a position that cannot lean anywhere)."""
    import torch

    x = torch.tensor(list(tokens), dtype=torch.long)[:, None]
    px = p.gather(1, x)[:, 0]
    context, qx = list(prompt_ids), px.clone()
    for i, token in enumerate(tokens):
        found = lookup.lookup(context, 1)
        if found:
            qx[i] = float(found[0] == token)
        context.append(token)
    return lean_logs(px, qx)


def lean_logs(px, qx) -> list[float]:
    """For each weight w of DRAFT_WEIGHTS, the log of the product of ((1 - w)·px + w·qx) / px over
    the tokens the target can give (px > 0)."""
    import torch

    possible = px > 0
    px, qx = px[possible].double(), qx[possible].double()
    return [float(torch.log(((1 - w) * px + w * qx) / px).sum()) for w in DRAFT_WEIGHTS]


@dataclass
class SampledEvidence:
    """What the target's distribution says of one sampled output (see sampled_evidence)."""
    u: list[float]
    impossible: int = 0  # tokens the target gives probability 0
    draft_lean: list[float] | None = None  # draft_lean_logs or lookup_lean_logs, when drafted

    def to_dict(self) -> dict:
        return {"u": [round(v, 5) for v in self.u], "impossible": self.impossible, "draft_lean": self.draft_lean}

    @classmethod
    def from_dict(cls, data: dict) -> "SampledEvidence":
        return cls(list(data["u"]), data.get("impossible", 0), data.get("draft_lean"))


def sampled_evidence(target, prompt_ids: Sequence[int], output_ids: Sequence[int], params, seed: int,
                     draft=None, allowed=None) -> SampledEvidence:
    """An output's u values under the target, V drawn from `seed` (keep it apart from the seed the
    output was sampled with, or V and the draws may share their stream), and with `draft` (a
    loaded model, or a PromptLookupProposer) the logs of the martingales that grow when the output
    leans towards its drafts. With `allowed` (a structure's masks, as model_probabilities takes
    them), both models' distributions are those held to the structure, as they were sampled."""
    import torch

    p = model_probabilities(target, prompt_ids, output_ids, params, allowed=allowed)
    u, impossible = randomized_pit(p, output_ids, torch.Generator().manual_seed(seed))
    lean = None
    if draft is not None and output_ids and hasattr(draft, "lookup"):
        lean = lookup_lean_logs(p, draft, prompt_ids, output_ids)
    elif draft is not None and output_ids:
        q = model_probabilities(draft, prompt_ids, output_ids, params, allowed=allowed)
        lean = draft_lean_logs(p, q, output_ids)
    return SampledEvidence(u, impossible, lean)


def uniformity_p_value(values: Sequence[float]) -> float:
    """Kolmogorov-Smirnov p-value of `values` against the uniform on [0, 1]: the asymptotic
    distribution with Stephens' correction for small samples (within a few percent of the
    exact one from 5 values up)."""
    n = len(values)
    if n == 0:
        return 1.0
    ordered = sorted(values)
    d = max(max((i + 1) / n - u, u - i / n) for i, u in enumerate(ordered))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return 1.0  # the series below converges slowly here, to 1
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, p))


def draft_lean_p_value(logs: Sequence[Sequence[float]]) -> float:
    """The p-value of outputs' draft_lean_logs together: 1 / the mean over weights of the product
    of their martingales (Ville's inequality), at most 1."""
    totals = [sum(run[i] for run in logs) for i in range(len(DRAFT_WEIGHTS))]
    top = max(totals)
    log_e = top + math.log(sum(math.exp(t - top) for t in totals) / len(totals))
    return math.exp(-log_e) if log_e > 0 else 1.0


def sampled_p_values(runs: Sequence[SampledEvidence]) -> dict[str, float]:
    """The p-values of outputs tested together: "KS" (any departure) and, where the outputs were
    drafted by a model or prompt lookup, "towards the draft"."""
    tests = {"KS": uniformity_p_value([u for e in runs for u in e.u])}
    leans = [e.draft_lean for e in runs if e.draft_lean is not None]
    if leans:
        tests["towards the draft"] = draft_lean_p_value(leans)
    return tests


def check_sampled_output(evidence: SampledEvidence | Sequence[SampledEvidence],
                         alpha: float = SAMPLED_ALPHA) -> Verdict:
    """Sampled outputs (one, or several tested together) against the target's distribution; each
    test at alpha over the number of tests, so that a lossless sampler is refused at most at alpha."""
    runs = [evidence] if isinstance(evidence, SampledEvidence) else list(evidence)
    impossible = sum(e.impossible for e in runs)
    if impossible:
        return Verdict(INVALID, f"sampled output has {impossible} token(s) the target gives probability 0")
    tests = sampled_p_values(runs)
    level = alpha / len(tests)
    what = (f"{sum(len(e.u) for e in runs)} sampled tokens against the target's distribution: "
            + ", ".join(f"{name} p = {p:.3g}" for name, p in tests.items()))
    failed = [name for name, p in tests.items() if p < level]
    if failed:
        return Verdict(INVALID, f"{what}; {' and '.join(failed)} below {level:g}: not drawn from the target's "
                                f"distribution")
    return Verdict(VALID, what)


# ---------------------------------------------------------------- accounting


def check_accounting(spec: dict, emitted: int, origins: Sequence[str] | None = None,
                     target_passes: int | None = None) -> Verdict:
    """The counters of a speculative run (SpecStats.to_dict()) against what was emitted and run."""
    accepted, recovered, bonus = spec["accepted"], spec["recovered"], spec["bonus"]
    plain = spec.get("plain")  # absent from records of older versions, which counted those tokens as bonus
    problems = []
    if accepted + recovered + bonus + (plain or 0) != emitted:
        problems.append(f"accepted {accepted} + recovered {recovered} + bonus {bonus} + plain {plain or 0} = "
                        f"{accepted + recovered + bonus + (plain or 0)}, but {emitted} tokens were emitted")
    if target_passes is not None and target_passes != spec["rounds"]:
        problems.append(f"the target ran {target_passes} passes but {spec['rounds']} rounds were counted")
    if accepted > spec["drafted"]:
        problems.append(f"{accepted} accepted of only {spec['drafted']} drafted")
    by_position = spec.get("accepted_by_position")
    if by_position is not None and sum(by_position) != accepted:
        problems.append(f"acceptance by position sums to {sum(by_position)}, not {accepted}")
    if origins is not None:
        counted = {kind: list(origins).count(kind) for kind in ("draft", "recovered", "bonus", "target")}
        found = [counted["draft"], counted["recovered"], counted["bonus"], counted["target"]]
        expected = [accepted, recovered, bonus, plain]
        if plain is None:  # an older record: its bonus counted the plain tokens too
            found, expected = [*found[:2], found[2] + found[3]], expected[:3]
        if found != expected:
            problems.append(f"token origins {counted} disagree with the counters")
    if problems:
        return Verdict(INVALID, "accounting: " + "; ".join(problems))
    return Verdict(VALID, "counts add up")


# ---------------------------------------------------------------- physics


def speedup_bound(gamma: float, acceptance: float) -> float:
    """The most speculation can gain: 1 + γ·acceptance tokens per pass that costs at least one plain step."""
    return 1.0 + gamma * acceptance


def check_speedup(speedup: float, bound: float, how: str, slack: float = DEFAULT_SLACK) -> Verdict:
    """`how` explains the bound, e.g. '1 + γ·acceptance = 1 + 4 × 0.002'."""
    if speedup > bound * (1 + slack):
        return Verdict(IMPOSSIBLE, f"speed-up {speedup:.2f}x exceeds {how} = {bound:.4g}x, the most possible: "
                                   f"a target pass yields at most one token beyond the drafts it keeps "
                                   f"and costs at least one plain step")
    return Verdict(VALID, f"speed-up {speedup:.2f}x within {bound:.4g}x")


def check_bandwidth(tok_s: float, tokens_per_pass: float, model_bytes: float, bandwidth_gb_s: float,
                    what: str = "speculative", slack: float = DEFAULT_SLACK) -> Verdict:
    """A token cannot take less than (bytes read per pass / bandwidth) / tokens per pass."""
    floor_s = model_bytes / (bandwidth_gb_s * 1e9) / tokens_per_pass
    if tok_s <= 0:
        return Verdict(VALID, f"{what}: no tokens timed")
    per_token_s = 1.0 / tok_s
    if per_token_s * (1 + slack) < floor_s:
        return Verdict(IMPOSSIBLE, f"{what} {tok_s:.1f} tok/s is {per_token_s * 1e3:.3g} ms per token, under the "
                                   f"{floor_s * 1e3:.3g} ms that reading {model_bytes / 1e9:.3g} GB per pass at "
                                   f"{bandwidth_gb_s:g} GB/s takes for {tokens_per_pass:.3g} tokens per pass")
    return Verdict(VALID, f"{what} within bandwidth")


# ---------------------------------------------------------------- rows from any tool


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a CSV file (by suffix) or a JSONL file (one object per line)."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no file at {str(path)!r}")
    text = read_text(path)
    if path.suffix.lower() == ".csv":
        return _csv_rows(path, text)
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                raise VerispecError(f"{path}:{number}: not a JSON object (expected CSV or JSONL)")
            rows.append(row)
    return rows


def _csv_rows(path: Path, text: str) -> list[dict]:
    rows = []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    for row in reader:
        if None in row:  # DictReader files values beyond the header under the key None
            raise VerispecError(f"{path}:{reader.line_num}: more values than the header has columns")
        if any((value or "").strip() for value in row.values()):
            rows.append(row)
    return rows


def reported_speedup(row: dict) -> float | None:
    """spec_tok_s / baseline_tok_s of a row that audit_row has read, or None without a positive baseline."""
    baseline, spec = _number(row, "baseline_tok_s", "row"), _number(row, "spec_tok_s", "row")
    return spec / baseline if baseline > 0 else None


def _number(row: dict, column: str, row_name: str, required: bool = True) -> float | None:
    value = row.get(column)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise VerispecError(f"{row_name}: no value in column {column!r} "
                                f"(needed: {', '.join(REQUIRED_COLUMNS)})")
        return None
    text = str(value).strip()
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise VerispecError(f"{row_name}: column {column!r} holds {value!r}, not a number") from None
    if not math.isfinite(number):
        raise VerispecError(f"{row_name}: column {column!r} holds {value!r}, not a finite number")
    return number


def audit_row(row: dict, row_name: str = "row", slack: float = DEFAULT_SLACK) -> Verdict:
    """The physics and accounting rules applied to one reported result."""
    baseline, spec = _number(row, "baseline_tok_s", row_name), _number(row, "spec_tok_s", row_name)
    gamma, acceptance = _number(row, "gamma", row_name), _number(row, "acceptance", row_name)
    if baseline <= 0 or spec <= 0 or gamma < 0:
        return Verdict(INVALID, "speeds must be positive and γ at least 0")
    if not 0 <= acceptance <= 1:
        return Verdict(INVALID, f"accounting: acceptance {acceptance:g} is not a fraction in [0, 1]")
    speedup = spec / baseline
    bound = speedup_bound(gamma, acceptance)
    checks = [_check_row_counts(row, row_name, speedup, acceptance),
              check_speedup(speedup, bound, f"1 + γ·acceptance = 1 + {gamma:g} × {acceptance:.3g}", slack)]
    model_bytes = _number(row, "model_bytes", row_name, required=False)
    bandwidth = _number(row, "bandwidth_gb_s", row_name, required=False)
    if model_bytes and bandwidth:
        checks.append(check_bandwidth(baseline, 1.0, model_bytes, bandwidth, "baseline", slack))
        checks.append(check_bandwidth(spec, bound, model_bytes, bandwidth, "speculative", slack))
    return worst(checks)


def _check_row_counts(row: dict, row_name: str, speedup: float, acceptance: float) -> Verdict:
    """The optional columns, where a tool reports them, must agree with each other."""
    get = {c: _number(row, c, row_name, required=False) for c in (
        "speedup", "accepted", "drafted", "recovered", "bonus", "tokens", "rounds", "target_passes")}
    problems = []
    claimed = get["speedup"]
    if claimed is not None and abs(claimed - speedup) > 0.01 * speedup + 0.005:
        problems.append(f"the reported speed-up {claimed:g}x is not spec / baseline = {speedup:.3g}x")
    if get["accepted"] is not None and get["drafted"]:
        if get["accepted"] > get["drafted"]:
            problems.append(f"{get['accepted']:g} accepted of only {get['drafted']:g} drafted")
        elif abs(get["accepted"] / get["drafted"] - acceptance) > 0.005:
            problems.append(f"acceptance {acceptance:.3g} is not accepted / drafted = "
                            f"{get['accepted'] / get['drafted']:.3g}")
    parts = [get[c] for c in ("accepted", "recovered", "bonus")]
    if get["tokens"] is not None and None not in parts and sum(parts) != get["tokens"]:
        problems.append(f"accepted + recovered + bonus = {sum(parts):g}, not the {get['tokens']:g} tokens")
    if get["rounds"] is not None and get["target_passes"] is not None and get["rounds"] != get["target_passes"]:
        problems.append(f"{get['target_passes']:g} target passes but {get['rounds']:g} rounds")
    if problems:
        return Verdict(INVALID, "accounting: " + "; ".join(problems))
    return Verdict(VALID, "")


# ---------------------------------------------------------------- runs measured here


def decode_passes(run: dict) -> int | None:
    """Target passes after the prefill: the passes that the decode time (and tok/s) covers."""
    passes = run.get("target_passes")
    if passes is None and run.get("spec"):
        passes = run["spec"]["rounds"]
    return passes - 1 if passes else None


def tokens_per_decode_pass(run: dict) -> float | None:
    passes = decode_passes(run)
    timed = run["completion_tokens"] - 1  # the first token comes from the prefill pass
    return timed / passes if passes and timed > 0 else None


def physics_of_run(run: dict, baseline_tok_s: float | None, slack: float = DEFAULT_SLACK) -> Verdict:
    """Speed-up within 1 + accepted drafts per decode pass; tok/s within bandwidth when it is known.

    `baseline_tok_s` is the target alone on the same prompt (the median of its repeats).
    """
    checks = []
    spec = run.get("spec")
    passes = decode_passes(run)
    if spec and passes and baseline_tok_s and run.get("tok_s"):
        bound = 1.0 + spec["accepted"] / passes
        checks.append(check_speedup(run["tok_s"] / baseline_tok_s, bound,
                                    f"1 + accepted drafts per pass = 1 + {spec['accepted']}/{passes}", slack))
    tokens_per_pass = tokens_per_decode_pass(run)
    if run.get("model_bytes") and run.get("bandwidth_gb_s") and tokens_per_pass:
        what = "speculative" if spec else "baseline"
        checks.append(check_bandwidth(run["tok_s"], tokens_per_pass, run["model_bytes"],
                                      run["bandwidth_gb_s"], what, slack))
    return worst(checks) if checks else Verdict(VALID, "")


def run_checks(run: dict, baseline_tok_s: float | None, output: Verdict | None = None,
               slack: float = DEFAULT_SLACK) -> dict[str, Verdict]:
    """The output, accounting and physics verdicts of one measured run.

    `output` is the output verdict (judging a tie needs the model); without one it is read
    from the record, so that a report re-audits counts and physics from the JSONL alone.
    """
    if output is None:
        output = Verdict.from_dict((run.get("audit") or {}).get("output"))
    accounting = Verdict(VALID, "")
    if run.get("spec"):
        accounting = check_accounting(run["spec"], run["completion_tokens"], run.get("origins"),
                                      run.get("target_passes"))
    return {"output": output, "accounting": accounting, "physics": physics_of_run(run, baseline_tok_s, slack)}


def audit_run(run: dict, baseline_tok_s: float | None, output: Verdict | None = None,
              slack: float = DEFAULT_SLACK) -> Verdict:
    """The worst of a run's three verdicts."""
    return worst(run_checks(run, baseline_tok_s, output, slack).values())
