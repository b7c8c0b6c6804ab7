"""Raw results: one JSON object per line, appended as runs finish."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from verispec.errors import VerispecError


def read_records(path: str | Path, fields: Mapping[str, type] | None = None) -> list[dict]:
    """Every record of a JSONL file; a torn last line (an interrupted write) is ignored.

    With `fields` (name: type), every record must hold those fields with values of those types.
    """
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no results file at {str(path)!r}")
    records = []
    lines = read_text(path).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise VerispecError(f"{path}:{number}: not a JSON object") from None
        if not isinstance(record, dict):
            raise VerispecError(f"{path}:{number}: not a JSON object but {_kind(record)}")
        problem = _field_problem(record, fields or {})
        if problem:
            raise VerispecError(f"{path}:{number}: {problem}")
        records.append(record)
    return records


def runs_by_key(path: str | Path) -> dict[str, dict]:
    """The runs a results file already holds, by key, to reuse rather than run again."""
    if not Path(path).is_file():
        return {}
    return {r["key"]: r for r in read_records(path) if isinstance(r.get("key"), str)}


def read_text(path: Path) -> str:
    """A text file's contents; a byte that is not UTF-8 is a one-line error naming its line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # spreadsheets often begin a UTF-8 file with a byte-order mark
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise VerispecError(f"{path}:{line}: not UTF-8 text; save the file as UTF-8") from None


_KINDS = {str: "text", int: "a whole number", float: "a number", dict: "an object", list: "a list",
          bool: "true or false", type(None): "null"}


def _kind(value: object) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _field_problem(record: dict, fields: Mapping[str, type]) -> str | None:
    for name, expected in fields.items():
        if name not in record:
            return f"no field {name!r} (is this a results file of `verispec bench`, `sweep` or `demo`?)"
        value = record[name]
        # JSON has one number type, so a whole number is a number too; true and false are not numbers
        allowed = (int, float) if expected is float else expected
        if not isinstance(value, allowed) or (isinstance(value, bool) and expected in (int, float)):
            return f"field {name!r} holds {_kind(value)}, expected {_KINDS.get(expected, expected.__name__)}"
    return None


def repair_torn_tail(path: Path) -> None:
    """Cut a last line that was only partly written, so that appending starts on a fresh line.

    A last line that is a whole record, only missing its newline, is kept.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    try:
        json.loads(data[keep:])
    except ValueError:  # also a line cut inside a multi-byte character
        with open(path, "r+b") as f:
            f.truncate(keep)
    else:
        with open(path, "ab") as f:
            f.write(b"\n")


def check_results_path(path: str | Path) -> None:
    """Fail at once, before any slow work, when records could not be written to `path`."""
    path = Path(path)
    if path.is_dir():
        raise VerispecError(f"{path} is a folder; give a JSONL file to write the results to")
    folder = next(parent for parent in path.parents if parent.exists())
    if not folder.is_dir():
        raise VerispecError(f"cannot write {path}: {folder} is a file, not a folder")


class RecordWriter:
    """Appends records to a JSONL file, flushed after each so that an interruption loses at most one.

    `fresh` discards the file's earlier records, and only when the first new record is written:
    a run that fails before it has anything to write (a missing model, a draft whose tokenizer
    differs) leaves the file as it was.
    """

    def __init__(self, path: str | Path, fresh: bool = False):
        self.path = Path(path)
        check_results_path(self.path)
        self.fresh = fresh
        self.opened = False

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.fresh:
            self.path.write_text("")
        else:
            repair_torn_tail(self.path)
        self.opened = True

    def write(self, record: dict) -> None:
        if not self.opened:
            self._open()
        with open(self.path, "a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_all(self, records: Iterable[dict]) -> None:
        for record in records:
            self.write(record)
