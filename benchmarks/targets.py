"""Every performance target on this machine: the scripts that check them, one after another,
and their verdicts together at the end.

    make bench                                 # first: llama-cpp-python for target 6
    python benchmarks/targets.py               # targets 1-7 (and 8 where CUDA is present); about an hour on 2 cores
    python benchmarks/targets.py --only 1 3 7  # the scripts that check these targets
    python benchmarks/targets.py --quick       # each script's --quick: a rehearsal, not figures to quote

The scripts run one at a time (two timed runs side by side would slow each other). Their
output goes to the terminal and to results/perf/<host>/targets_run_<HHMM>.log. At the end
the verdict lines ("[    MET] 1 bandwidth, int4: ...") of all of them are printed again
together; the exit status is 1 if any target is NOT MET or a script failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from perf_common import verdict

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Check:
    targets: tuple[int, ...]
    script: str
    quick: bool = True  # the script takes --quick
    judges: bool = True  # the script prints verdict lines (gpu_bench.py prints figures only)


# Quickest first, so that a broken set-up shows within a minute.
CHECKS = (
    Check((7,), "overhead.py"),
    Check((1, 3), "decode_bandwidth.py"),
    Check((2,), "agreement.py"),
    Check((4, 5), "speedup.py"),
    Check((6,), "vs_llama_cpp.py"),
    Check((8,), "gpu_bench.py", quick=False, judges=False),
)

VERDICT = re.compile(r"^\[\s*(MET|NOT MET|n/a)\] ")


@dataclass
class Outcome:
    check: Check
    returncode: int
    verdicts: list[str] = field(default_factory=list)
    crashed: bool = False  # it printed a traceback


def planned(only: set[int] | None, cuda: bool) -> tuple[list[Check], list[str]]:
    """The checks to run for the targets in `only` (all where None), and a verdict line for
    each one left out because this machine cannot run it."""
    chosen = [c for c in CHECKS if only is None or only.intersection(c.targets)]
    skipped = []
    if not cuda and any(c.script == "gpu_bench.py" for c in chosen):
        chosen = [c for c in chosen if c.script != "gpu_bench.py"]
        skipped.append(verdict("8 GPU", "no CUDA device here (the tests run gpu_bench.py --tiny on the CPU)", None))
    return chosen, skipped


def run_check(check: Check, quick: bool, log: TextIO, scripts: Path = HERE) -> Outcome:
    """Runs one script with this Python, its output streamed to the terminal and `log`."""
    options = ["--quick"] if quick and check.quick else []
    command = [sys.executable, str(scripts / check.script)] + options
    header = f"$ python {' '.join([check.script] + options)}  ({time.strftime('%H:%M')})"
    print(header, flush=True)
    log.write(header + "\n")
    outcome = Outcome(check, 0)
    with subprocess.Popen(command, cwd=scripts, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"}) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            log.write(line)
            if VERDICT.match(line):
                outcome.verdicts.append(line.rstrip("\n"))
            outcome.crashed |= line.startswith("Traceback (most recent call last)")
    outcome.returncode = process.returncode
    log.flush()
    return outcome


def summary(outcomes: list[Outcome], skipped: list[str]) -> tuple[list[str], bool]:
    """The verdict lines of every script, a line for each script that failed (or printed no
    verdict where it should), and whether every target was met. A script whose target is not
    met may exit with status 1; that alone is not a failure."""
    lines, ok = [], True
    for outcome in outcomes:
        check, lines = outcome.check, lines + outcome.verdicts
        not_met = any(v.startswith("[NOT MET]") for v in outcome.verdicts)
        ok &= not not_met
        if outcome.crashed or (outcome.returncode != 0 and not not_met):
            ok = False
            lines.append(f"[ FAILED] {check.script} exited with status {outcome.returncode}")
        elif check.judges and not outcome.verdicts:
            ok = False
            lines.append(f"[ FAILED] {check.script} printed no verdict")
        elif not check.judges:
            lines.append(verdict(", ".join(map(str, check.targets)), f"{check.script} ran; its figures are above", None))
    return lines + skipped, ok


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None, scripts: Path = HERE, results: Path | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="+", choices=range(1, 9), metavar="N",
                        help="only the scripts that check these targets (1-8)")
    parser.add_argument("--quick", action="store_true", help="each script's --quick")
    args = parser.parse_args(argv)
    if results is None:
        from perf_common import RESULTS as results
    checks, skipped = planned(set(args.only) if args.only else None, cuda_available())
    results.mkdir(parents=True, exist_ok=True)
    log_path = results / f"targets{'_quick' if args.quick else ''}_run_{time.strftime('%H%M')}.log"
    with log_path.open("w") as log:
        outcomes = [run_check(check, args.quick, log, scripts) for check in checks]
        lines, ok = summary(outcomes, skipped)
        log.write("\nevery verdict:\n" + "".join(line + "\n" for line in lines))
    print("\nevery verdict:")
    for line in lines:
        print(line)
    print(f"(all output in {log_path})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
