"""`verispec sweep CONFIG.yaml`: a resumable grid of benchmark runs into one JSONL file."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("sweep", help="run a grid of benchmarks from a YAML file (resumable)",
                            description="targets × weight formats × prompt sets × proposers × γ × repeats; "
                                        "runs already in the output file are skipped, so an interrupted "
                                        "sweep resumes where it stopped.")
    parser.add_argument("config", help="the sweep's YAML file (see verispec.lab.sweep for its keys)")
    parser.add_argument("--out", "-o", default=None, help="JSONL file (default: the config's 'out')")
    parser.add_argument("--restart", action="store_true", help="discard earlier results and run everything")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    from verispec.lab.records import read_records
    from verispec.lab.report import print_tables, summarize
    from verispec.lab.sweep import check_out_is_not_config, load_sweep_config, run_sweep

    console = Console(highlight=False)
    config = load_sweep_config(args.config)
    out = args.out or config.out
    check_out_is_not_config(out, args.config)
    try:
        summary = run_sweep(config, out=out, fresh=args.restart, console=console)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: finished runs are kept; rerun `verispec sweep {args.config}` "
                      f"to resume[/yellow]")
        raise
    console.print(f"{summary.executed} run(s) done now, {summary.skipped} already done, of {summary.total} "
                  f"→ {summary.out}")
    records = read_records(summary.out)
    rows = summarize(records, config.settings.slack)
    print_tables(console, rows, records)
    return 0 if all(row.verdict.valid for row in rows) else 1
