"""`verispec models`: the demo models, installed or not."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("models", help="list (or install) the demo models")
    parser.add_argument("--install", action="store_true", help="download, join and verify the demo models")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from verispec.loading.demo_models import DEMO_MODELS, install_all, is_intact, model_path, models_dir

    console = Console()
    if args.install:
        install_all(log=lambda msg: console.print(msg))
    table = Table(title=f"demo models in {models_dir()}")
    for column in ("name", "model", "size", "state", "path"):
        table.add_column(column)
    for name, model in DEMO_MODELS.items():
        path = model_path(name)
        if not path.is_file():
            table.add_row(name, model.description, "-", "not installed", "-")
            continue
        state = "verified" if is_intact(model, path) else "[red]damaged: run --install[/red]"
        table.add_row(name, model.description, f"{path.stat().st_size / 1e6:,.0f} MB", state, str(path))
    console.print(table)
    return 0
