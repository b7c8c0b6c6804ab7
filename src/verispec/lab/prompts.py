"""Prompt sets for benchmarks.

A source is one of
    spec-bench                  all of Spec-Bench's 480 questions
    spec-bench:CAT[,CAT...]     the questions of the named categories
    FILE.jsonl                  Spec-Bench's format: {"turns": [...], "category": ...} per line
    FILE                        plain text, one prompt per line
The first turn of a question is its prompt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError

SPEC_BENCH = "spec-bench"
SPEC_BENCH_ENV = "VERISPEC_SPEC_BENCH"
# Spec-Bench's 480 prompts (Apache-2.0; data/spec_bench/SOURCE.md says where they come from)
SPEC_BENCH_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "spec_bench" / "question.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


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
    """The prompts of `source`; with `limit`, K per named category, or K spread over all categories."""
    if limit is not None and limit < 1:
        raise VerispecError(f"the prompt limit must be at least 1, got {limit}")
    if source == SPEC_BENCH or source.startswith(SPEC_BENCH + ":"):
        prompts = _read_jsonl(spec_bench_path())
        named = [c for c in source.partition(":")[2].split(",") if c]
        if named:
            prompts = _only_categories(prompts, named)
            return _per_category(prompts, limit) if limit else prompts
        return _spread(prompts, limit) if limit else prompts
    path = Path(source).expanduser()
    if not path.is_file():
        raise VerispecError(f"no prompts at {source!r}: not a file, nor {SPEC_BENCH}[:category]")
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
            prompt_id = str(record.get("question_id", number))
            prompts.append(Prompt(prompt_id, str(record.get("category", "default")), str(text)))
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


def _spread(prompts: list[Prompt], limit: int) -> list[Prompt]:
    """`limit` prompts taken in turn from each category, so that every category is represented."""
    groups = list(_by_category(prompts).values())
    chosen: list[Prompt] = []
    depth = 0
    while len(chosen) < limit and any(depth < len(g) for g in groups):
        chosen.extend(g[depth] for g in groups if depth < len(g))
        depth += 1
    return chosen[:limit]
