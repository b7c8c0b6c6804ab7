"""Tables and plots, derived from a results JSONL alone.

Every speculative run is paired with the baseline run of the same target,
weights, prompt and repeat, and re-audited from its raw numbers (the output
verdict, which needs the model to judge a tie, is taken from the record). Runs
that fail an audit are left out of every speed-up. A row's speed-up is the
median of per-prompt ratios (each prompt's ratio the median over its repeats),
shown with their min and max.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from verispec.errors import VerispecError
from verispec.lab.audit import (DEFAULT_SLACK, TIE, VALID, SampledEvidence, Verdict, check_sampled_output,
                                run_checks)
from verispec.lab.records import read_records

SEED_COLUMNS = ["Draft length γ", "Baseline tok/s", "Speculative tok/s", "Speedup", "Acceptance"]
# what the tables need of every record (runs written by `verispec bench`, `sweep` or `demo`)
RUN_FIELDS = {"target": str, "weights": str, "prompt_set": str, "prompt_id": object, "proposer": str,
              "gamma": int, "tok_s": float, "completion_tokens": int}
PLOTS = ("speedup_vs_gamma.png", "acceptance_vs_gamma.png", "acceptance_by_position.png", "time_split.png")


@dataclass
class Row:
    """One speculative configuration (target, weights, prompts, proposer, γ, schedule) over its runs."""
    target: str
    weights: str
    prompt_set: str
    proposer: str
    proposer_kind: str
    gamma: int
    adaptive: bool | str
    lookup: bool | None = None  # whether prompt lookup's drafts could take a draft model's rounds (None: not weighed)
    draft_vocab: int | None = None  # a draft model's first ids (and the context's) it proposes; None: all
    runs: int = 0
    excluded: int = 0  # runs left out of the speed-up after failing an audit
    baseline_tok_s: float | None = None
    spec_tok_s: float | None = None
    speedup: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    acceptance: float | None = None
    tokens_per_pass: float | None = None
    accepted: int = 0
    recovered: int = 0
    acceptance_by_position: list[float] = field(default_factory=list)
    split_ms: dict[str, float] = field(default_factory=dict)  # per timed token
    prompt_tokens: float = 0.0  # mean over the row's runs
    decoded_tokens: float = 0.0  # mean tokens after the first, the ones tok/s counts
    verdict: Verdict = field(default_factory=Verdict)
    predicted: float | None = None

    @property
    def group(self) -> tuple:
        return (self.target, self.weights, self.prompt_set, self.proposer, self.adaptive, self.lookup,
                self.draft_vocab)

    @property
    def schedule(self) -> str:
        """How the row drafts beyond its proposer and γ: its schedule and a draft vocabulary."""
        parts = [f"adaptive: {self.adaptive}{', no lookup' if self.lookup is False else ''}"] if self.adaptive else []
        if self.draft_vocab is not None:
            parts.append(f"vocab: {self.draft_vocab:,}")
        return f" ({'; '.join(parts)})" if parts else ""


def _prompt_key(record: dict) -> tuple:
    return (record["target"], record["weights"], record["prompt_set"], record["prompt_id"])


def _median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def baseline_speeds(records: list[dict]) -> dict[tuple, float]:
    """The target alone on each prompt: the median tok/s of its repeats."""
    runs: dict[tuple, list[float]] = {}
    for record in records:
        if record.get("proposer_kind") == "baseline":
            runs.setdefault(_prompt_key(record), []).append(record["tok_s"])
    return {key: statistics.median(speeds) for key, speeds in runs.items()}


def _weighs_lookup(record: dict) -> bool | None:
    """Whether prompt lookup could take a draft model's rounds; None where it is not weighed
    (records written before the flag: lookup was on wherever it applied)."""
    if "lookup" in record:
        return record["lookup"]
    return True if record.get("adaptive") == "cost" and record.get("proposer_kind", "draft") == "draft" else None


def summarize(records: list[dict], slack: float = DEFAULT_SLACK) -> list[Row]:
    """One Row per speculative configuration, in the order the records first name them."""
    baselines = baseline_speeds(records)
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        if record.get("proposer_kind") != "baseline":
            key = (record["target"], record["weights"], record["prompt_set"], record["proposer"],
                   record["gamma"], record.get("adaptive") or False, _weighs_lookup(record), record.get("draft_vocab"))
            groups.setdefault(key, []).append(record)
    rows = [_row(key, runs, baselines, slack) for key, runs in groups.items()]
    order = {group: i for i, group in enumerate(dict.fromkeys(r.group for r in rows))}
    return sorted(rows, key=lambda r: (order[r.group], r.gamma))


def _row(key: tuple, runs: list[dict], baselines: dict[tuple, float], slack: float) -> Row:
    target, weights, prompt_set, proposer, gamma, adaptive, lookup, draft_vocab = key
    row = Row(target, weights, prompt_set, proposer, runs[0].get("proposer_kind", "draft"), gamma, adaptive,
              lookup, draft_vocab, runs=len(runs))
    checks = [run_checks(run, baselines.get(_prompt_key(run)), slack=slack) for run in runs]
    kept = [run for run, c in zip(runs, checks)
            if all(v.valid for v in c.values()) and baselines.get(_prompt_key(run))]
    row.excluded = len(runs) - len(kept)
    row.verdict = _row_verdict(checks, [SampledEvidence.from_dict(run["sampled"]) for run in runs
                                        if run.get("sampled")])

    speeds: dict[tuple, list[float]] = {}
    for run in kept:
        speeds.setdefault(_prompt_key(run), []).append(run["tok_s"])
    per_prompt = {key: statistics.median(s) for key, s in speeds.items()}
    ratios = [speed / baselines[key] for key, speed in per_prompt.items()]
    if ratios:
        row.speedup, row.speedup_min, row.speedup_max = statistics.median(ratios), min(ratios), max(ratios)
    row.spec_tok_s = _median(per_prompt.values())
    row.baseline_tok_s = _median(baselines[key] for key in per_prompt)

    counted = kept or runs  # acceptance does not depend on timing
    row.prompt_tokens = statistics.fmean(run.get("prompt_tokens", 0) for run in counted)
    row.decoded_tokens = statistics.fmean(max(run["completion_tokens"] - 1, 0) for run in counted)
    stats = [run["spec"] for run in counted if run.get("spec")]
    drafted = sum(s["drafted"] for s in stats)
    row.accepted = sum(s["accepted"] for s in stats)
    row.recovered = sum(s["recovered"] for s in stats)
    row.acceptance = row.accepted / drafted if drafted else 0.0
    rounds = sum(s["rounds"] for s in stats)
    tokens = sum(s["accepted"] + s["recovered"] + s["bonus"] + s.get("plain", 0) for s in stats)
    row.tokens_per_pass = tokens / rounds if rounds else None
    row.acceptance_by_position = _pooled_by_position(stats)
    row.split_ms = _split_ms(kept)
    return row


def _row_verdict(checks: list[dict[str, Verdict]], sampled: list[SampledEvidence] | None = None) -> Verdict:
    """A wrong output or count fails the row. Timings above the physical bound fail it when they are
    most of its runs (its median claims the impossible); a few are noise, left out and counted.
    `sampled`: what the target's distribution says of each sampled run, tested together too (more
    tokens, more power)."""
    n = len(checks)
    wrong = [v for c in checks for v in (c["output"], c["accounting"]) if not v.valid]
    pooled = check_sampled_output(sampled) if sampled else None
    if pooled is not None and not wrong and not pooled.valid:
        return Verdict(pooled.status, f"the row's runs together: {pooled.reason}")
    if wrong:
        runs = sum(not (c["output"].valid and c["accounting"].valid) for c in checks)
        return Verdict(wrong[0].status, f"{runs} of {n} run(s) wrong, left out: {wrong[0].reason}", wrong[0].margin)
    too_fast = [c["physics"] for c in checks if not c["physics"].valid]
    if 2 * len(too_fast) > n:
        return Verdict(too_fast[0].status, f"{len(too_fast)} of {n} run(s): {too_fast[0].reason}")
    ties = [c["output"] for c in checks if c["output"].status == TIE]
    note = (f"; {len(too_fast)} of {n} run(s) timed above the physical bound (a busy machine?), left out"
            if too_fast else "")
    if ties:
        return Verdict(TIE, f"{len(ties)} of {n} run(s) differ from the target alone only at a logit tie{note}",
                       min(v.margin for v in ties))
    if pooled is not None:
        return Verdict(VALID, f"all {n} run(s) follow the target's distribution; together, {pooled.reason}{note}")
    return Verdict(VALID, f"all {n} run(s) match the target alone{note}")


def _pooled_by_position(stats: list[dict]) -> list[float]:
    accepted: list[int] = []
    drafted: list[int] = []
    for s in stats:
        for i, (a, d) in enumerate(zip(s.get("accepted_by_position", []), s.get("drafted_by_position", []))):
            if i == len(drafted):
                accepted.append(0)
                drafted.append(0)
            accepted[i] += a
            drafted[i] += d
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def _split_ms(runs: Iterable[dict]) -> dict[str, float]:
    """Milliseconds per timed token (after the first) spent drafting, in target passes, and elsewhere."""
    totals = {"draft": 0.0, "target": 0.0, "other": 0.0}
    tokens = 0
    for run in runs:
        split = run.get("time_split") or {}
        for part in totals:
            totals[part] += split.get(f"{part}_s", 0.0)
        tokens += max(run["completion_tokens"] - 1, 0)
    return {part: 1e3 * seconds / tokens for part, seconds in totals.items()} if tokens else {}


# ---------------------------------------------------------------- predictions from the cost model


def predictor(profile_path: str | Path) -> Callable[[Row], float | None]:
    """The cost model's predicted speed-up for a row, from a calibration profile of this machine.

    α is estimated from the row's counts (accepted / (accepted + rejections)); c, the draft's
    two-position step and its reading of the prompt (spread over the row's decoded tokens)
    come from the profile for draft models, and are zero for prompt lookup and synthetic
    drafts. Rows of another target than the profile's, adaptive rows and rows whose draft
    vocabulary is not the one the profile timed the draft's steps with get no prediction.
    """
    try:
        from verispec.lab.calibrate import load_profile
        from verispec.lab.costmodel import MeasuredCosts, alpha_from_counts, predict_speedup
    except ImportError:
        raise VerispecError("the cost model is not available in this installation; run without --profile") from None
    profile = load_profile(profile_path)
    if profile.target is None:
        raise VerispecError(f"{profile_path}: the profile has no target timings to predict from")
    costs = profile.costs() if profile.draft else MeasuredCosts(
        dict(zip(profile.target.positions, profile.target.seconds)), 0.0)

    def predict(row: Row) -> float | None:
        if row.adaptive or row.target != profile.target.model or row.weights != profile.target.weights:
            return None
        alpha = alpha_from_counts(row.accepted, row.recovered)
        if row.proposer_kind != "draft":
            return predict_speedup(alpha, row.gamma, 0.0, costs.r)
        if profile.draft is None or row.draft_vocab != profile.draft.vocab:
            return None
        return predict_speedup(alpha, row.gamma, costs.c, costs.r, costs.draft_r2,
                               costs.prompt_cost(row.prompt_tokens, row.decoded_tokens))

    return predict


# ---------------------------------------------------------------- tables


def machine_line(records: list[dict]) -> str:
    machines = list({str(r.get("machine")): r.get("machine") for r in records if r.get("machine")}.values())
    if not machines:
        return "machine: unknown"
    parts = [f"{m.get('processor', '?')}, {m.get('threads', '?')} threads, torch {m.get('torch', '?')}, "
             f"{m.get('accelerator', m.get('device', '?'))}" for m in machines]
    return "machine: " + " | ".join(parts)


def _group_title(row: Row) -> str:
    return f"{row.target} ({row.weights}) · {row.proposer}{row.schedule} · {row.prompt_set}"


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _cells(row: Row, with_prediction: bool) -> list[str]:
    speedup = "–"
    if row.speedup is not None:
        speedup = f"{row.speedup:.2f}x ({row.speedup_min:.2f}–{row.speedup_max:.2f})"
    cells = [str(row.gamma), _fmt(row.baseline_tok_s, ".2f"), _fmt(row.spec_tok_s, ".2f"), speedup,
             _fmt(row.acceptance, ".1%"), _fmt(row.tokens_per_pass, ".2f")]
    if with_prediction:
        cells.append("–" if row.predicted is None else f"{row.predicted:.2f}x")
    cells.append(_verdict_cell(row))
    return cells


def _verdict_cell(row: Row) -> str:
    verdict = row.verdict
    cell = verdict.status if verdict.status != TIE else f"{TIE}, margin {verdict.margin:.2g}"
    return cell + (f" ({row.excluded} of {row.runs} left out)" if row.excluded else "")


def _notes(rows: list[Row]) -> list[tuple[Row, str]]:
    """The reasons behind verdicts that are not plain VALID, one line per row."""
    return [(r, f"γ = {r.gamma}{r.schedule}: {r.verdict.status}: {r.verdict.reason}")
            for r in rows if r.verdict.status != VALID or r.excluded]


def _headers(with_prediction: bool) -> list[str]:
    return [*SEED_COLUMNS, "Tokens/pass", *(["Predicted"] if with_prediction else []), "Audit"]


def _grouped(rows: list[Row]) -> dict[tuple, list[Row]]:
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    return groups


def markdown(rows: list[Row], records: list[dict], source: str = "") -> str:
    with_prediction = any(r.predicted is not None for r in rows)
    headers = _headers(with_prediction)
    lines = ["# Speculative decoding results", "",
             f"{machine_line(records)}. {len(records)} runs{f' from `{source}`' if source else ''}. "
             f"Speedup: median over prompts of (median speculative tok/s / median tok/s of the target alone), "
             f"with min–max; runs that fail an audit are left out. Greedy outputs are checked token for token "
             f"against the target alone, sampled ones against the target's distribution.", ""]
    for group in _grouped(rows).values():
        lines += [f"## {_group_title(group[0])}", "",
                  "| " + " | ".join(headers) + " |",
                  "|" + "|".join("---:" if i < len(headers) - 1 else "---" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r, with_prediction)) + " |" for r in group]
        notes = [f"- {note}" for _, note in _notes(group)]
        lines += ["", *notes, ""] if notes else [""]
    lines += [f"![{name.removesuffix('.png').replace('_', ' ')}]({name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


def print_tables(console, rows: list[Row], records: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    with_prediction = any(r.predicted is not None for r in rows)
    headers = _headers(with_prediction)
    console.print(f"[dim]{escape(machine_line(records))}[/dim]")
    for group in _grouped(rows).values():
        table = Table(title=escape(_group_title(group[0])), title_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, justify="right" if i < len(headers) - 1 else "left")
        for row in group:
            style = "green" if row.verdict.valid else "bold red"
            cells = [escape(c) for c in _cells(row, with_prediction)]
            table.add_row(*cells[:-1], f"[{style}]{cells[-1]}[/{style}]")
        console.print(table)
        for row, note in _notes(group):
            console.print(f"  {escape(note)}", style="dim" if row.verdict.valid else "red")


# ---------------------------------------------------------------- plots


def _labeller(rows: list[Row]) -> Callable[[Row], str]:
    """Series labels that name only what differs between the series."""
    fields = [("target", lambda r: r.target), ("weights", lambda r: r.weights),
              ("proposer", lambda r: r.proposer + r.schedule), ("prompts", lambda r: r.prompt_set)]
    varying = [get for _, get in fields if len({get(r) for r in rows}) > 1] or [fields[2][1]]
    return lambda row: " · ".join(get(row) for get in varying)


def plot(rows: list[Row], records: list[dict], out_dir: Path) -> list[Path]:
    """Draw the four PNG plots into out_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    label = _labeller(rows)
    series = _grouped(rows)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in series.values():
        shown = [r for r in group if r.speedup is not None]
        if shown:
            low = [r.speedup - r.speedup_min for r in shown]
            high = [r.speedup_max - r.speedup for r in shown]
            ax.errorbar([r.gamma for r in shown], [r.speedup for r in shown], yerr=[low, high], marker="o",
                        capsize=3, label=label(group[0]))
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(sorted({r.gamma for r in rows}))
    _finish(ax, "draft length γ", "speed-up over the target alone (median, min–max)", "Speed-up vs γ")
    paths.append(_save(fig, out_dir / PLOTS[0]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for group in series.values():
        ax.plot([r.gamma for r in group], [r.acceptance for r in group], marker="o", label=label(group[0]))
    ax.set_ylim(0, 1.05)
    ax.set_xticks(sorted({r.gamma for r in rows}))
    _finish(ax, "draft length γ", "acceptance (accepted / drafted)", "Acceptance vs γ")
    paths.append(_save(fig, out_dir / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        if row.acceptance_by_position:
            positions = range(1, len(row.acceptance_by_position) + 1)
            ax.plot(positions, row.acceptance_by_position, marker=".", label=f"{label(row)} γ={row.gamma}")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _finish(ax, "draft position", "rounds that kept the draft at this position", "Acceptance by draft position")
    paths.append(_save(fig, out_dir / PLOTS[2]))

    paths.append(_plot_time_split(plt, rows, records, label, out_dir / PLOTS[3]))
    return paths


def _plot_time_split(plt, rows: list[Row], records: list[dict], label: Callable[[Row], str], path: Path) -> Path:
    """Milliseconds per token: the target alone, then each configuration split into its parts."""
    bars: list[tuple[str, dict[str, float]]] = []
    several_targets = len({(r.target, r.weights) for r in rows}) > 1
    for row in rows:
        base_key = (row.target, row.weights, row.prompt_set)
        if base_key not in {key for key, _ in bars if isinstance(key, tuple)}:
            alone = [r for r in records if r.get("proposer_kind") == "baseline"
                     and (r["target"], r["weights"], r["prompt_set"]) == base_key]
            name = f"{row.target} ({row.weights}) alone" if several_targets else "target alone"
            bars.append((base_key, {"name": name, **_split_ms(alone)}))
        if row.split_ms:
            bars.append((None, {"name": f"{label(row)} γ={row.gamma}", **row.split_ms}))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(bars) + 1.6))
    left = [0.0] * len(bars)
    for part, colour, legend in (("target", "tab:blue", "target passes"), ("draft", "tab:purple", "drafting"),
                                 ("other", "tab:grey", "other")):
        widths = [split.get(part, 0.0) for _, split in bars]
        ax.barh(range(len(bars)), widths, left=left, color=colour, label=legend)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(bars)), [split["name"] for _, split in bars], fontsize=7)
    ax.invert_yaxis()
    _finish(ax, "milliseconds per timed token", None, "Where the time goes")
    return _save(fig, path)


def _finish(ax, xlabel: str, ylabel: str | None, title: str) -> None:
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


# ---------------------------------------------------------------- all of it


@dataclass
class Report:
    rows: list[Row]
    records: list[dict]
    markdown_path: Path | None = None
    plots: list[Path] = field(default_factory=list)


def build_report(results: str | Path, out_dir: str | Path | None = None, profile: str | Path | None = None,
                 slack: float = DEFAULT_SLACK) -> Report:
    """Summarise a results JSONL; with out_dir, write results.md and the plots there."""
    records = read_records(results, RUN_FIELDS)
    if not records:
        raise VerispecError(f"{results}: holds no runs")
    rows = summarize(records, slack)
    if profile is not None:
        predict = predictor(profile)
        for row in rows:
            row.predicted = predict(row)
    report = Report(rows, records)
    if out_dir is not None and rows:
        out_dir = Path(out_dir)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise VerispecError(f"cannot make the report folder {out_dir}: a file is in the way; "
                                f"choose another with --out") from None
        report.markdown_path = out_dir / "results.md"
        report.markdown_path.write_text(markdown(rows, records, Path(results).name))
        report.plots = plot(rows, records, out_dir)
    return report
