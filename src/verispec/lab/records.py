"""Raw results: one JSON object per line, appended as runs finish."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from verispec.errors import VerispecError


def read_records(path: str | Path) -> list[dict]:
    """Every record of a JSONL file; a torn last line (an interrupted write) is ignored."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no results file at {str(path)!r}")
    records = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise VerispecError(f"{path}:{number}: not a JSON object") from None
    return records


def repair_torn_tail(path: Path) -> None:
    """Cut a last line that was only partly written, so that appending starts on a fresh line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(keep)


class RecordWriter:
    """Appends records to a JSONL file, flushed after each so that an interruption loses at most one."""

    def __init__(self, path: str | Path, fresh: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.path.write_text("")
        else:
            repair_torn_tail(self.path)

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def write_all(self, records: Iterable[dict]) -> None:
        for record in records:
            self.write(record)
