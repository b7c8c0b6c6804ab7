"""Produce the README's table and plots: a sweep, then the report, from one YAML file.

    python benchmarks/spec_bench_pair.py                              # the demo pair (benchmarks/pair.yaml)
    python benchmarks/spec_bench_pair.py benchmarks/synthetic_alpha.yaml
    python benchmarks/spec_bench_pair.py benchmarks/smoke.yaml        # a quick rehearsal on SmolLM2-135M

Raw runs go to benchmarks/results/<config name>/runs.jsonl; the table (results.md) and
the PNG plots are drawn from that file alone. The sweep is resumable: rerun the same
command after an interruption. Speed-ups are ratios measured within one run; time on an
idle machine, since other jobs on the same cores skew every ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=str(HERE / "pair.yaml"), help="sweep YAML")
    parser.add_argument("--out", default=None, help="folder (default: benchmarks/results/<config name>)")
    parser.add_argument("--restart", action="store_true", help="discard earlier runs of this config")
    args = parser.parse_args()

    from rich.console import Console

    from verispec.lab.report import build_report, print_tables
    from verispec.lab.sweep import load_sweep_config, run_sweep

    console = Console(highlight=False)
    out_dir = Path(args.out or HERE / "results" / Path(args.config).stem)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > 0.25 * cores:
        console.print(f"[yellow]load average {load:.1f} on {cores} cores: the machine is busy, "
                      f"timings will be noisy[/yellow]")
    config = load_sweep_config(args.config)
    summary = run_sweep(config, out=out_dir / "runs.jsonl", fresh=args.restart, console=console)
    console.print(f"{summary.executed} run(s) now, {summary.skipped} from before → {summary.out}")
    report = build_report(summary.out, out_dir)
    print_tables(console, report.rows, report.records)
    console.print(f"wrote {report.markdown_path} and {', '.join(p.name for p in report.plots)}")
    return 0 if all(row.verdict.valid for row in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
