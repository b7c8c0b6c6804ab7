"""The demo: the target alone, a draft model at γ = 4 and prompt lookup, side by side and audited.

On the demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft) and a few Spec-Bench
prompts (coding first, then one from another category), it shows one answer with
each token coloured by where it came from, and the audited table. Its budget is
sized to end within a few minutes on two CPU cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from verispec.lab.prompts import Prompt, load_prompts

DEMO_TARGET = "qwen2.5-coder-1.5b"
DEMO_DRAFT = "qwen2.5-coder-0.5b"
DEMO_GAMMA = 4
DEMO_CATEGORIES = ("coding", "math_reasoning")  # all but the last prompt from the first, one from the second


@dataclass
class DemoOptions:
    target: str = DEMO_TARGET
    draft: str = DEMO_DRAFT
    weights: str | None = None
    draft_weights: str | None = None
    device: str = "cpu"
    limit: int = 3
    max_tokens: int = 48
    gamma: int = DEMO_GAMMA
    prompts: str | None = None  # a prompt source instead of the Spec-Bench pick
    out: str | None = "results/demo.jsonl"


def demo_prompts(options: DemoOptions) -> tuple[str, list[Prompt]]:
    """(prompt set name, prompts): by default limit-1 coding questions and one from another category."""
    if options.prompts:
        return options.prompts, load_prompts(options.prompts, options.limit)
    first, second = DEMO_CATEGORIES
    prompts = load_prompts(f"spec-bench:{first}", max(1, options.limit - 1))
    if options.limit > 1:
        prompts += load_prompts(f"spec-bench:{second}", 1)
    return f"spec-bench:{first},{second}", prompts


def run_demo(options: DemoOptions, console) -> int:
    """Run the demo; 0 when every row of the audited table is VALID."""
    from verispec.commands.generate import ORIGIN_STYLE
    from verispec.lab.bench import Bench, BenchSettings, RunConfig, parse_proposer
    from verispec.lab.records import RecordWriter
    from verispec.lab.report import print_tables, summarize
    from verispec.config import draft_format

    # checks the path before the models load; the last demo's records go only when this one has one
    writer = RecordWriter(options.out, fresh=True) if options.out else None
    prompt_set, prompts = demo_prompts(options)
    console.rule("[bold]verispec demo[/bold]")
    console.print(f"target [bold]{options.target}[/bold], draft [bold]{options.draft}[/bold]; "
                  f"{len(prompts)} Spec-Bench prompt(s), greedy, {options.max_tokens} tokens each: "
                  f"the target alone, the draft at γ = {options.gamma}, and prompt lookup at γ = {options.gamma}")
    target = _load(console, options.target, options.weights, options.device)
    draft = _load(console, options.draft, draft_format(options.weights, options.draft_weights), options.device)
    configs = [RunConfig(parse_proposer(options.draft), options.gamma), RunConfig(parse_proposer("ngram"), options.gamma)]

    def show(record: dict) -> None:
        if writer:
            writer.write(record)
        ratio = f" · {record['speedup']:.2f}x" if record.get("speedup") else ""
        console.print(f"  #{record['prompt_id']:<4} {record['category']:<15} {_config_label(record):<28} "
                      f"{record['completion_tokens']:>4} tokens at {record['tok_s']:6.2f} tok/s{ratio}  "
                      f"[dim]{record['audit']['status']}[/dim]")

    bench = Bench(target, BenchSettings(max_tokens=options.max_tokens, repeats=1),
                  {options.draft: draft}, on_record=show)
    console.print("[dim]warming up, then running (baseline first for every prompt)[/dim]")
    records = bench.run(prompt_set, prompts, configs)

    answer = next(r for r in records if r["proposer_kind"] == "draft")
    console.rule(f"answer to #{answer['prompt_id']} ({answer['category']}), speculative with {options.draft}")
    _print_coloured(console, target.tokenizer, answer, ORIGIN_STYLE)
    console.print("legend: [magenta]kept draft[/magenta]  [red]recovered (the target's token at a rejection)"
                  "[/red]  [green]bonus[/green]  plain = the target's own step")
    if options.out:
        console.print(f"[dim]raw runs: {options.out} (`verispec report {options.out}` redraws the table below)[/dim]")
    console.rule("audited results")
    rows = summarize(records)
    print_tables(console, rows, records)
    return 0 if all(row.verdict.valid for row in rows) else 1


def _load(console, spec: str, weights: str | None, device: str):
    from verispec.lab.bench import load_for_bench

    started = time.perf_counter()
    with console.status(f"loading {spec}"):
        loaded = load_for_bench(spec, weights, device)
    console.print(f"loaded {spec} ({loaded.weights}) in {time.perf_counter() - started:.1f} s")
    return loaded


def _config_label(record: dict) -> str:
    if record["proposer_kind"] == "baseline":
        return "target alone"
    name = "prompt lookup" if record["proposer_kind"] == "ngram" else Path(record["proposer"]).name
    return f"{name} γ={record['gamma']}"


def _print_coloured(console, tokenizer, record: dict, styles: dict[str, str]) -> None:
    from verispec.generate import TextAssembler

    text = TextAssembler(tokenizer, ())
    for token_id, origin in zip(record["token_ids"], record["origins"]):
        piece, _ = text.add(token_id)
        console.print(piece, end="", style=styles[origin], markup=False, highlight=False, soft_wrap=True)
    console.print(text.flush(), markup=False, highlight=False)
