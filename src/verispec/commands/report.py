"""`verispec report RESULTS.jsonl`: the audited tables and plots, from the raw runs alone."""

from __future__ import annotations

from pathlib import Path

from verispec.commands.options import add_slack_option


def register(sub) -> None:
    parser = sub.add_parser("report", help="tables (printed and Markdown) and PNG plots from a results JSONL")
    parser.add_argument("results", help="JSONL file written by `verispec bench`, `sweep` or `demo`")
    parser.add_argument("--out", "-o", default=None,
                        help="folder for results.md and the plots (default: beside the results file, named "
                             "after it: runs.jsonl → runs/, runs → runs-report/)")
    parser.add_argument("--profile", default=None,
                        help="a calibration profile (`verispec calibrate`): show the cost model's predicted "
                             "speed-up beside the measured one")
    add_slack_option(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    from verispec.lab.report import build_report, print_tables

    console = Console(highlight=False)
    results = Path(args.results)
    out_dir = Path(args.out) if args.out else default_out_dir(results)
    report = build_report(results, out_dir, args.profile, args.slack)
    print_tables(console, report.rows, report.records)
    if report.markdown_path:
        console.print(f"[dim]wrote {report.markdown_path} and {len(report.plots)} plots in {out_dir}[/dim]")
    return 0 if all(row.verdict.valid for row in report.rows) else 1


def default_out_dir(results: Path) -> Path:
    """Named after the results file: its name less the suffix, or with '-report' when it has none."""
    folder = results.with_suffix("")
    return folder if folder != results else results.with_name(results.name + "-report")
