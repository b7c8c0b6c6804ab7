"""Check the cost model against measured speculative decoding on this machine.

1. Calibrate the target's verify-cost curve r(m) and the draft's c on the loaded pair,
   at a context as long as the runs below will see on average, and the time the draft
   takes to read each prompt (a draft model reads the prompt once per request before it
   can draft; the engine counts that in decoding time, so the prediction must too).
2. Decode Spec-Bench's coding prompts (first turn, chat template, greedy) with the target
   alone and speculatively for each γ, interleaved prompt by prompt so that a change in
   machine load hits every configuration alike. The calibration of step 1 runs in short
   bursts before every prompt and after the last, and its figures are the means over the
   bursts: on a shared host the memory bandwidth left to a job drifts by a third within
   minutes, and a calibration taken at one moment would price decoding at another.
3. From each γ's measured acceptance α = accepted / (accepted + rejections), predict the
   speed-up E[tokens per cycle] / (γ·c + r(γ+1)), less the draft's prompt reading spread
   over the decoded tokens, and compare it with the measured one (speculative tok/s over
   the target's tok/s in the same run). The draft's cost counts its two-position first
   step after a fully kept round (draft r(2)); the textbook E / (γ·c + r(γ+1)) is shown
   beside it.

The real numbers (about four minutes on 2 cores):

    .venv/bin/python benchmarks/costmodel_check.py --weights int8 --draft-weights int4 --limit 5 \\
        --max-tokens 128 --out benchmarks/results/costmodel_check.json

A quick proof that it runs:

    .venv/bin/python benchmarks/costmodel_check.py --target smollm2-135m --draft smollm2-135m \\
        --limit 1 --max-tokens 16 --gammas 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from verispec.config import draft_format
from verispec.generate import encode_prompt, generate
from verispec.lab.calibrate import load_average, machine_facts, time_model
from verispec.lab.costmodel import MeasuredCosts, alpha_from_counts, draft_cost, expected_tokens, predict_speedup
from verispec.lab.prompts import spec_bench_path
from verispec.loading import load_model

TOLERANCE = 0.15


@dataclass
class Totals:
    """Sums over prompts for one configuration (γ = 0 is the target alone)."""

    gamma: int
    tokens: int = 0  # tokens after the first, the ones decode_s covers
    decode_s: float = 0.0
    rounds: int = 0  # target passes after the prefill
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0
    drafted: int = 0
    identical: list[bool] = field(default_factory=list)  # output equals the target alone, per prompt

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    def add(self, result, reference_ids: list[int] | None) -> None:
        self.tokens += len(result.token_ids) - 1
        self.decode_s += result.timings.decode_s
        if result.spec is not None:
            spec = result.spec
            self.rounds += spec.rounds - 1
            self.accepted += spec.accepted
            self.recovered += spec.recovered
            self.bonus += spec.bonus
            self.drafted += spec.drafted
        if reference_ids is not None:
            self.identical.append(result.token_ids == reference_ids)


def coding_prompts(path: Path, limit: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [row["turns"][0] for row in rows if row.get("category") == "coding"]
    if not prompts:
        sys.exit(f"no coding prompts in {path}")
    return prompts[:limit]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--weights", default=None, help="target weight format (default: the engine's, float32)")
    parser.add_argument("--draft-weights", default=None, help="draft weight format (default: the target's)")
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--limit", type=int, default=5, help="coding prompts to run (Spec-Bench has 10)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per calibrated size and burst")
    parser.add_argument("--questions", type=Path, default=None,
                        help="a Spec-Bench question.jsonl (default: the copy shipped with verispec)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the raw results here as JSON")
    return parser.parse_args(argv)


class Calibration:
    """Bursts of calibration between the decoding runs, and the costs they average to."""

    def __init__(self, target, draft, max_m: int, context: int, repeats: int, prompt_lengths: list[int]):
        self.target, self.draft = target, draft
        self.max_m, self.context, self.repeats = max_m, context, repeats
        self.lengths = sorted(set(prompt_lengths))
        self.bursts: list[dict] = []

    def burst(self) -> None:
        timing = time_model(self.target, range(1, self.max_m + 1), self.context, self.repeats)
        draft = time_model(self.draft, [1, 2], self.context, self.repeats, last_only=True,
                           prefill_lengths=self.lengths)
        self.bursts.append({"target": asdict(timing), "draft": asdict(draft)})

    def costs(self) -> MeasuredCosts:
        def mean(role: str, key: str, index: int) -> float:
            return statistics.fmean(b[role][key][index] for b in self.bursts)

        target_s = {m: mean("target", "seconds", i) for i, m in enumerate(range(1, self.max_m + 1))}
        prefill_s = {n: mean("draft", "prefill_seconds", i) for i, n in enumerate(self.lengths)}
        return MeasuredCosts(target_s, mean("draft", "seconds", 0), mean("draft", "seconds", 1), prefill_s)

    def record(self) -> dict:
        costs = self.costs()
        return {"bursts": self.bursts, "target_s": costs.target_s, "draft_step_s": costs.draft_step_s,
                "draft_two_s": costs.draft_two_s, "draft_prefill_s": costs.draft_prefill_s, "c": costs.c}


def run_all(target, draft, prompts: list[str], gammas: list[int], max_tokens: int,
            calibration: Calibration) -> dict[int, Totals]:
    totals = {g: Totals(g) for g in [0, *gammas]}
    options = dict(max_tokens=max_tokens, temperature=0.0, chat=True)
    for gamma in totals:  # warm-up: first calls allocate buffers and pick kernels
        generate(target, prompts[0], draft=draft if gamma else None, gamma=gamma, **{**options, "max_tokens": 4})
    for index, prompt in enumerate(prompts):
        calibration.burst()
        reference = generate(target, prompt, **options)
        totals[0].add(reference, None)
        for gamma in gammas:
            result = generate(target, prompt, draft=draft, gamma=gamma, **options)
            totals[gamma].add(result, reference.token_ids)
        print(f"  prompt {index + 1}/{len(prompts)}: {len(reference.token_ids)} tokens", flush=True)
    calibration.burst()
    return totals


def compare(totals: dict[int, Totals], costs: MeasuredCosts, prompt_lengths: list[int]) -> list[dict]:
    baseline = totals[0].tokens_per_s
    reading_s = sum(costs.draft_prefill(n) for n in prompt_lengths)  # once per prompt
    rows = []
    for gamma, t in totals.items():
        if gamma == 0:
            continue
        alpha = alpha_from_counts(t.accepted, t.recovered)
        measured = t.tokens_per_s / baseline
        reading = reading_s / costs.target_step_s / t.tokens if t.tokens else 0.0  # target steps per token
        predicted = predict_speedup(alpha, gamma, costs.c, costs.r, costs.draft_r2, reading)
        per_round = (t.tokens / t.rounds) if t.rounds else 0.0
        cycle = draft_cost(alpha, gamma, costs.c, costs.draft_r2) + costs.r(gamma + 1)
        rows.append({
            "gamma": gamma, "alpha": alpha, "acceptance_rate": t.accepted / t.drafted if t.drafted else 0.0,
            "tokens_per_round": per_round, "expected_tokens": expected_tokens(alpha, gamma),
            "r_next": costs.r(gamma + 1), "c": costs.c, "draft_r2": costs.draft_r2,
            "prompt_reading_per_token": reading,
            "baseline_tps": baseline, "speculative_tps": t.tokens_per_s,
            "measured_speedup": measured, "predicted_speedup": predicted,
            "predicted_textbook": predict_speedup(alpha, gamma, costs.c, costs.r),
            # the same costs with the measured tokens per round instead of E(α): separates the
            # acceptance model's error from the cost model's
            "predicted_from_tokens_per_round": 1 / (cycle / per_round + reading) if per_round else 0.0,
            "relative_error": predicted / measured - 1, "within_tolerance": abs(predicted / measured - 1) <= TOLERANCE,
            "identical_to_target": all(t.identical),
        })
    return rows


def print_table(rows: list[dict], baseline_tps: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"predicted vs measured speed-up (target alone {baseline_tps:.2f} tok/s)")
    for column in ("γ", "α", "tokens/round", "E(α)", "c", "r(γ+1)", "prompt/token", "spec tok/s", "measured",
                   "predicted", "error", f"within {TOLERANCE:.0%}", "textbook", "same output"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["gamma"]), f"{row['alpha']:.3f}", f"{row['tokens_per_round']:.2f}",
                      f"{row['expected_tokens']:.2f}", f"{row['c']:.3f}", f"{row['r_next']:.2f}",
                      f"{row['prompt_reading_per_token']:.3f}",
                      f"{row['speculative_tps']:.2f}", f"{row['measured_speedup']:.2f}×",
                      f"{row['predicted_speedup']:.2f}×", f"{row['relative_error']:+.1%}",
                      "yes" if row["within_tolerance"] else "NO", f"{row['predicted_textbook']:.2f}×",
                      "yes" if row["identical_to_target"] else "NO")
    Console(highlight=False, width=max(Console().width, 130)).print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = load_average()
    if load_before is not None and load_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load_before:.1f} on {os.cpu_count()} cores; timings will be noisy", flush=True)
    print(f"loading {args.target} and {args.draft}", flush=True)
    target = load_model(args.target, weights=args.weights)
    draft = load_model(args.draft, weights=draft_format(args.weights, args.draft_weights))
    prompts = coding_prompts(args.questions or spec_bench_path(), args.limit)
    prompt_lengths = [len(encode_prompt(target.tokenizer, p, chat=True)) for p in prompts]
    context = int(statistics.median(prompt_lengths) + args.max_tokens / 2)  # the average context while decoding
    calibration = Calibration(target, draft, max(args.gammas) + 1, context, args.repeats, prompt_lengths)
    print(f"decoding {len(prompts)} coding prompt(s), {args.max_tokens} tokens, γ = 0 (target alone), "
          f"{', '.join(map(str, args.gammas))}; calibrating r(m) for m = 1..{max(args.gammas) + 1}, c and the "
          f"draft's prompt reading (context {context}) before each prompt and after the last", flush=True)
    totals = run_all(target, draft, prompts, args.gammas, args.max_tokens, calibration)
    costs = calibration.costs()
    print(f"  c = {costs.c:.3f}, draft r(2) = {costs.draft_r2:.2f}; "
          + ", ".join(f"r({g + 1}) = {costs.r(g + 1):.2f}" for g in args.gammas)
          + f"; the draft reads the prompts in {sum(map(costs.draft_prefill, prompt_lengths)):.2f} s", flush=True)
    rows = compare(totals, costs, prompt_lengths)
    print_table(rows, totals[0].tokens_per_s)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": " ".join(sys.argv), "machine": machine_facts(), "load_average_before": load_before, "target": target.name, "draft": draft.name,
            "weights": [target.weights, draft.weights], "prompts": len(prompts), "max_tokens": args.max_tokens,
            "calibration": calibration.record(), "totals": {g: asdict(t) for g, t in totals.items()}, "rows": rows,
            "wall_s": time.perf_counter() - started}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
