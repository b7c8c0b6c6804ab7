"""A grid of benchmark runs described in YAML, resumable after an interruption.

    out: results/pair.jsonl          # one record per run (default: results/<config name>.jsonl)
    targets: [qwen2.5-coder-1.5b]    # demo names, GGUF files or HF folders
    weights: [float32, int8]         # weight formats of the target
    draft_weights: float32
    proposers: [qwen2.5-coder-0.5b, ngram, "synthetic:0.6", "synthetic:0.9"]
    gammas: [4, 8, 16]
    adaptive: [false]                # or cost / heuristic
    prompts: ["spec-bench:coding", prompts.txt]
    limit: 3                         # prompts per set (see verispec.lab.prompts)
    max_tokens: 64
    repeats: 3

Every run has a key (target, weights, prompt set, prompt, configuration, repeat,
token budget, temperature). Runs whose key is already in the output file are
not run again, so a sweep that was interrupted picks up where it stopped. Each
target is loaded once for all its runs, each draft model once for the sweep.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from verispec.errors import VerispecError
from verispec.lab.bench import (Bench, BenchSettings, RunConfig, load_for_bench, parse_proposer, plan_runs,
                                run_key, spec_configs)
from verispec.lab.prompts import Prompt, load_prompts
from verispec.lab.records import RecordWriter, read_records

WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")


@dataclass
class SweepConfig:
    targets: list[str]
    proposers: list[str]
    gammas: list[int] = field(default_factory=lambda: [4])
    weights: list[str] = field(default_factory=lambda: ["float32"])
    draft_weights: str | None = None
    adaptive: list[bool | str] = field(default_factory=lambda: [False])
    prompts: list[str] = field(default_factory=lambda: ["spec-bench"])
    limit: int | None = None
    out: str | None = None
    device: str = "cpu"
    threads: int | None = None
    settings: BenchSettings = field(default_factory=BenchSettings)

    def configs(self) -> list[RunConfig]:
        return spec_configs(self.proposers, self.gammas, self.adaptive)

    def draft_models(self) -> list[str]:
        return [p.label for p in map(parse_proposer, self.proposers) if p.kind == "draft"]


_SETTING_KEYS = {f.name for f in fields(BenchSettings)}
_LIST_KEYS = {"targets", "proposers", "gammas", "weights", "adaptive", "prompts"}
_KEYS = {f.name for f in fields(SweepConfig)} - {"settings"} | _SETTING_KEYS


def load_sweep_config(path: str | Path) -> SweepConfig:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no sweep configuration at {str(path)!r}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise VerispecError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise VerispecError(f"{path}: expected a mapping of settings (targets, proposers, gammas, ...)")
    return sweep_config_from_dict(raw, default_out=f"results/{path.stem}.jsonl", where=str(path))


def sweep_config_from_dict(raw: dict, default_out: str = "results/sweep.jsonl", where: str = "sweep") -> SweepConfig:
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise VerispecError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    for key in ("targets", "proposers"):
        if not raw.get(key):
            raise VerispecError(f"{where}: '{key}' is required (a list)")
    values = {k: ([v] if k in _LIST_KEYS and not isinstance(v, list) else v) for k, v in raw.items()}
    settings = BenchSettings(**{k: v for k, v in values.items() if k in _SETTING_KEYS})
    if isinstance(settings.ngram, list):
        settings.ngram = tuple(settings.ngram)
    config = SweepConfig(settings=settings, **{k: v for k, v in values.items()
                                               if k not in _SETTING_KEYS})
    config.out = config.out or default_out
    _validate(config, where)
    return config


def _validate(config: SweepConfig, where: str) -> None:
    for fmt in [*config.weights, *([config.draft_weights] if config.draft_weights else [])]:
        if fmt not in WEIGHT_FORMATS:
            raise VerispecError(f"{where}: unknown weight format {fmt!r}; choose from {', '.join(WEIGHT_FORMATS)}")
    if not all(isinstance(g, int) and g >= 1 for g in config.gammas):
        raise VerispecError(f"{where}: gammas must be whole numbers >= 1, got {config.gammas}")
    for schedule in config.adaptive:
        if schedule not in (False, "cost", "heuristic"):
            raise VerispecError(f"{where}: adaptive takes false, cost or heuristic, got {schedule!r}")
    s = config.settings
    if not (isinstance(s.max_tokens, int) and s.max_tokens >= 2):
        raise VerispecError(f"{where}: max_tokens must be a whole number >= 2 (tok/s is timed after the first)")
    if not (isinstance(s.repeats, int) and s.repeats >= 1):
        raise VerispecError(f"{where}: repeats must be a whole number >= 1")
    config.configs()  # parses every proposer


@dataclass
class SweepSummary:
    out: Path
    total: int
    executed: int
    skipped: int


def run_sweep(config: SweepConfig, out: str | Path | None = None, fresh: bool = False, console=None,
              on_record: Callable[[dict], None] | None = None) -> SweepSummary:
    """Run every run of the grid that the output file does not hold yet."""
    import torch

    out = Path(out or config.out)
    done = {} if fresh or not out.is_file() else {r["key"]: r for r in read_records(out) if "key" in r}
    writer = RecordWriter(out, fresh=fresh)
    if config.threads:
        torch.set_num_threads(config.threads)
    prompt_sets = {source: load_prompts(source, config.limit) for source in config.prompts}
    configs = config.configs()
    todo = {(target, weights): _pending(target, weights, prompt_sets, configs, config.settings, done)
            for target in config.targets for weights in config.weights}
    total = sum(len(plan_runs(p, configs, config.settings.repeats)) for p in prompt_sets.values()) * len(todo)
    pending = sum(todo.values())
    summary = SweepSummary(out, total, 0, total - pending)
    drafts: dict[str, object] = {}

    with _progress(console) as progress:
        task = progress.add_task("sweep", total=pending)

        def record_done(record: dict) -> None:
            writer.write(record)
            summary.executed += 1
            progress.advance(task)
            if on_record:
                on_record(record)

        for (target_spec, weights), count in todo.items():
            if count == 0:
                continue  # every run of this target is already in the file: do not even load it
            progress.update(task, description=f"loading {target_spec} ({weights})")
            target = load_for_bench(target_spec, weights, config.device)
            for name in config.draft_models():
                if name not in drafts:
                    progress.update(task, description=f"loading draft {name}")
                    drafts[name] = load_for_bench(name, config.draft_weights, config.device)
            bench = Bench(target, config.settings, drafts, on_record=record_done, done=done, label=target_spec,
                          on_run=lambda what: progress.update(task, description=f"{target_spec} {what}"))
            for source, prompts in prompt_sets.items():
                bench.run(source, prompts, configs)
            del bench, target
            gc.collect()
    return summary


def _pending(target: str, weights: str, prompt_sets: dict[str, list[Prompt]], configs: list[RunConfig],
             settings: BenchSettings, done: dict) -> int:
    return sum(run_key(target, weights, source, prompt.id, run_config, repeat, settings) not in done
               for source, prompts in prompt_sets.items()
               for prompt, run_config, repeat in plan_runs(prompts, configs, settings.repeats))


def _progress(console):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}", style="dim"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console,
                    transient=False)
