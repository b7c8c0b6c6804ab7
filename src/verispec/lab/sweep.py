"""A grid of benchmark runs described in YAML, resumable after an interruption.

    out: results/pair.jsonl          # one record per run (default: results/<config name>.jsonl)
    targets: [qwen2.5-coder-1.5b]    # demo names, GGUF files or HF folders
    weights: [float32, int8]         # weight formats of the target
    draft_weights: int4                # of the draft models (default: each target's weights)
    proposers: [qwen2.5-coder-0.5b, ngram, "synthetic:0.6", "synthetic:0.9"]
    gammas: [4, 8, 16]
    adaptive: [false]                # or cost / heuristic
    lookup: [true]                   # with cost: may prompt lookup's drafts take a draft model's rounds
    draft_vocab: [all, 32768]        # a draft model's first ids (and the context's) it may propose (default: auto)
    prompts: ["spec-bench:coding", prompts.txt, humaneval-infill]
    limit: 3                         # prompts per set (see verispec.lab.prompts)
    max_tokens: 64
    repeats: 3
    json_schema: {type: object}      # hold every output to a JSON schema (true: any object), or
    regex: "[0-9]+"                  # to a regular expression, or to a Lark grammar
    grammar: 'start: "yes" | "no"'   # (one of the three at most)

Every run has a key (target, weights, prompt set, prompt, configuration and a draft
model's format, repeat, token budget, temperature). Runs whose key is already in the
output file are not run again, so a sweep that was interrupted picks up where it
stopped. Each target is loaded once for all its runs, each draft model once per
weight format it runs in.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from verispec.config import draft_format
from verispec.errors import VerispecError
from verispec.generate import MAX_GAMMA
from verispec.lab.bench import (Bench, BenchSettings, RunConfig, load_for_bench, parse_proposer, plan_runs,
                                run_key, spec_configs)
from verispec.lab.prompts import Prompt, load_prompts
from verispec.lab.records import RecordWriter, runs_by_key
from verispec.quant import FORMATS as WEIGHT_FORMATS
from verispec.sampling import SEED_MAX, SEED_MIN
from verispec.values import is_number, is_whole



@dataclass
class SweepConfig:
    targets: list[str]
    proposers: list[str]
    gammas: list[int] = field(default_factory=lambda: [4])
    weights: list[str] = field(default_factory=lambda: ["float32"])
    draft_weights: str | None = None
    adaptive: list[bool | str] = field(default_factory=lambda: [False])
    lookup: list[bool] = field(default_factory=lambda: [True])
    draft_vocab: list[int | str | None] = field(default_factory=lambda: ["auto"])
    prompts: list[str] = field(default_factory=lambda: ["spec-bench"])
    limit: int | None = None
    out: str | None = None
    device: str = "cpu"
    threads: int | None = None
    settings: BenchSettings = field(default_factory=BenchSettings)

    def configs(self) -> list[RunConfig]:
        vocabularies = [None if choice == "all" else choice for choice in self.draft_vocab]
        return spec_configs(self.proposers, self.gammas, self.adaptive, self.lookup, vocabularies)

    def draft_format(self, target_weights: str) -> str:
        """The format the draft models run in beside a target in `target_weights`."""
        return draft_format(target_weights, self.draft_weights)

    def draft_models(self) -> list[str]:
        return [p.label for p in map(parse_proposer, self.proposers) if p.kind == "draft"]


_SETTING_KEYS = {f.name for f in fields(BenchSettings)}
_LIST_KEYS = {"targets", "proposers", "gammas", "weights", "adaptive", "lookup", "draft_vocab", "prompts"}
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
    """A checked SweepConfig: every key's type and range is checked here, before any slow work."""
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise VerispecError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}")
    for key in ("targets", "proposers"):
        if raw.get(key) is None:
            raise VerispecError(f"{where}: '{key}' is required (a list)")
    values = {k: ([v] if k in _LIST_KEYS and not isinstance(v, (list, dict)) else v) for k, v in raw.items()}
    for key, value in values.items():
        is_valid, expected = _EXPECTED[key]
        if not is_valid(value):
            raise VerispecError(f"{where}: '{key}' must be {expected}, got {_shown(raw[key])}")
    settings = BenchSettings(**{k: v for k, v in values.items() if k in _SETTING_KEYS})
    settings.ngram = tuple(settings.ngram)
    try:
        settings.structure()
    except VerispecError as exc:
        raise VerispecError(f"{where}: {exc}") from None
    config = SweepConfig(settings=settings, **{k: v for k, v in values.items()
                                               if k not in _SETTING_KEYS})
    config.out = config.out or default_out
    config.configs()  # parses every proposer
    return config


def _text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _one_or_more(is_item: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: isinstance(value, list) and bool(value) and all(map(is_item, value))


def _optional(is_valid: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or is_valid(value)


def _is_flag(value: object) -> bool:
    return isinstance(value, bool)


def _is_weight_format(value: object) -> bool:
    return isinstance(value, str) and value in WEIGHT_FORMATS


def _is_schedule(value: object) -> bool:
    return value is False or value in ("cost", "heuristic")


def _is_ngram(value: object) -> bool:
    return (isinstance(value, list) and len(value) == 2 and all(is_whole(n, 1) for n in value)
            and value[1] <= value[0])


_FORMATS = ", ".join(WEIGHT_FORMATS)

# key: (check of its value after a lone value became a list, what the key takes)
_EXPECTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "targets": (_one_or_more(_text), "one or more model names (demo names, GGUF files or HF folders)"),
    "proposers": (_one_or_more(_text), "one or more proposers (draft models, ngram, synthetic:α)"),
    "gammas": (_one_or_more(lambda g: is_whole(g, 1, MAX_GAMMA)), f"one or more whole numbers from 1 to {MAX_GAMMA}"),
    "weights": (_one_or_more(_is_weight_format), f"one or more weight formats ({_FORMATS})"),
    "draft_weights": (_optional(_is_weight_format), f"a weight format ({_FORMATS})"),
    "adaptive": (_one_or_more(_is_schedule), "one or more of false, cost and heuristic"),
    "lookup": (_one_or_more(_is_flag), "true, false or [true, false] (with adaptive: cost, whether prompt "
                                       "lookup's drafts may take a draft model's rounds)"),
    "draft_vocab": (_one_or_more(lambda n: n in (None, "all", "auto") or is_whole(n, 1)),
                    "auto, all, a whole number >= 1 or a list of them (a draft model's first token ids; all or "
                    "null: the whole vocabulary; auto: 32768 of more than 65536)"),
    "prompts": (_one_or_more(_text), "one or more prompt sources (spec-bench[:CATEGORY] or files)"),
    "limit": (_optional(lambda n: is_whole(n, 1)), "a whole number >= 1 (prompts per set)"),
    "out": (_optional(_text), "a file name"),
    "device": (_text, "a device name (cpu, cuda)"),
    "threads": (_optional(lambda n: is_whole(n, 1)), "a whole number >= 1"),
    "max_tokens": (lambda n: is_whole(n, 2), "a whole number >= 2 (tok/s is timed after the first token)"),
    "repeats": (lambda n: is_whole(n, 1), "a whole number >= 1"),
    "temperature": (lambda t: is_number(t, 0), "a number >= 0 (0: greedy)"),
    "seed": (lambda n: is_whole(n, SEED_MIN, SEED_MAX), "a whole number that fits in 64 bits"),
    "chat": (_optional(_is_flag), "true, false or null (null: when the model has a chat template)"),
    "ignore_eos": (_is_flag, "true or false"),
    "warmup": (_is_flag, "true or false"),
    "bandwidth_gb_s": (_optional(lambda b: is_number(b, 0)), "a number of GB/s >= 0"),
    "slack": (lambda x: is_number(x, high=1) and x > 0, "a number in (0, 1]"),
    "ngram": (_is_ngram, "[MAX, MIN]: two whole numbers >= 1 with MIN <= MAX"),
    "json_schema": (lambda v: v is None or isinstance(v, (bool, dict)),
                    "a JSON schema (a mapping), true for any JSON object, or false/null for none"),
    "regex": (_optional(_text), "a regular expression"),
    "grammar": (_optional(_text), "a Lark grammar (llguidance's dialect)"),
}
assert set(_EXPECTED) == _KEYS, "every key of a sweep needs its check"


def _shown(value: object) -> str:
    """A value as the user wrote it in YAML (JSON is close enough), cut short when long."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class SweepSummary:
    out: Path
    total: int
    executed: int
    skipped: int


def run_sweep(config: SweepConfig, out: str | Path | None = None, fresh: bool = False, console=None,
              on_record: Callable[[dict], None] | None = None) -> SweepSummary:
    """Run every run of the grid that the output file does not hold yet.

    `fresh` discards the file's earlier records once the first new record is written (RecordWriter).
    """
    import torch

    out = Path(out or config.out)
    writer = RecordWriter(out, fresh=fresh)  # checks the path now, writes only with the first record
    done = {} if fresh else runs_by_key(out)
    prompt_sets = {source: load_prompts(source, config.limit) for source in config.prompts}
    configs = config.configs()
    todo = {(target, weights): _pending(target, weights, config.draft_format(weights), prompt_sets, configs,
                                        config.settings, done)
            for target in config.targets for weights in config.weights}
    _check_models_exist(config, [target for (target, _), count in todo.items() if count])
    if config.threads:
        torch.set_num_threads(config.threads)
    total = sum(len(plan_runs(p, configs, config.settings.repeats)) for p in prompt_sets.values()) * len(todo)
    pending = sum(todo.values())
    summary = SweepSummary(out, total, 0, total - pending)
    drafts: dict[str, object] = {}  # the draft models, loaded in `drafts_format`
    drafts_format = None

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
            if config.draft_format(weights) != drafts_format:
                drafts, drafts_format = {}, config.draft_format(weights)  # one format in memory at a time
            for name in config.draft_models():
                if name not in drafts:
                    progress.update(task, description=f"loading draft {name} ({drafts_format})")
                    drafts[name] = load_for_bench(name, drafts_format, config.device)
            bench = Bench(target, config.settings, drafts, on_record=record_done, done=done, label=target_spec,
                          on_run=lambda what: progress.update(task, description=f"{target_spec} {what}"))
            for source, prompts in prompt_sets.items():
                bench.run(source, prompts, configs)
            del bench, target
            gc.collect()
    return summary


def _check_models_exist(config: SweepConfig, targets: list[str]) -> None:
    """A misspelt model fails now, not after hours of runs of the models before it."""
    from verispec.loading import resolve

    for spec in [*dict.fromkeys(targets), *(config.draft_models() if targets else [])]:
        resolve(spec)


def check_out_is_not_config(out: str | Path, config_path: str | Path) -> None:
    """Results appended to (or --restart emptying) the sweep's own YAML file would destroy it."""
    out, config_path = Path(out), Path(config_path)
    same = (out.samefile(config_path) if out.exists() and config_path.exists()
            else out.resolve() == config_path.resolve())
    if same:
        raise VerispecError(f"the results file {str(out)!r} is the sweep configuration itself; "
                            f"give a JSONL file for the results")


def _pending(target: str, weights: str, draft_weights: str, prompt_sets: dict[str, list[Prompt]],
             configs: list[RunConfig], settings: BenchSettings, done: dict) -> int:
    return sum(run_key(target, weights, source, prompt.id, run_config, repeat, settings, draft_weights) not in done
               for source, prompts in prompt_sets.items()
               for prompt, run_config, repeat in plan_runs(prompts, configs, settings.repeats))


def _progress(console):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("{task.description}", style="dim"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console,
                    transient=False)
