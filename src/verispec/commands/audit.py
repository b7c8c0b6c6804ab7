"""`verispec audit FILE`: the physics and accounting rules applied to results from any tool."""

from __future__ import annotations

from verispec.commands.options import add_slack_option


def register(sub) -> None:
    parser = sub.add_parser("audit", help="check reported speed-ups against physics and their own counts",
                            description="FILE is CSV or JSONL with the columns baseline_tok_s, spec_tok_s, gamma, "
                                        "acceptance (a fraction) and, where known, model_bytes (bytes read per "
                                        "pass; for a mixture of experts at least the active weights) and "
                                        "bandwidth_gb_s. Exits 1 when any row fails.")
    parser.add_argument("file", help="CSV or JSONL of reported results")
    add_slack_option(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.markup import escape

    from verispec.lab.audit import IMPOSSIBLE, audit_row, read_rows, reported_speedup

    console = Console(highlight=False)
    rows = read_rows(args.file)
    failed = 0
    for number, row in enumerate(rows, 1):
        name = str(row.get("label") or f"row {number}")
        verdict = audit_row(row, name, args.slack)
        failed += not verdict.valid
        style = "green" if verdict.valid else ("bold red" if verdict.status == IMPOSSIBLE else "red")
        speedup = reported_speedup(row)
        ratio = "speed-up undefined" if speedup is None else f"{speedup:.2f}x"
        console.print(f"{escape(name)}: γ = {row['gamma']}, {row['baseline_tok_s']} → {row['spec_tok_s']} tok/s "
                      f"({ratio}) at acceptance {row['acceptance']}: [{style}]{verdict.status}[/{style}]")
        console.print(f"  {escape(verdict.reason)}", style="dim" if verdict.valid else None)
    if failed:
        console.print(f"[bold red]{failed} of {len(rows)} row(s) fail the audit[/bold red]")
    else:
        console.print(f"[green]all {len(rows)} row(s) pass[/green]")
    return 1 if failed else 0
