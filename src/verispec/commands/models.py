"""`verispec models`: the demo models, installed or not."""

from __future__ import annotations


def register(sub) -> None:
    parser = sub.add_parser("models", help="list (or install) the demo models")
    parser.add_argument("--install", action="store_true", help="download, join and verify the demo models")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from verispec.loading.demo_models import DEMO_MODELS, install_all, model_path, models_dir

    console = Console()
    if args.install:
        install_all(log=lambda msg: console.print(msg))
    table = Table(title=f"demo models in {models_dir()}")
    for column in ("name", "model", "size", "path"):
        table.add_column(column)
    for name, model in DEMO_MODELS.items():
        path = model_path(name)
        size = f"{path.stat().st_size / 1e6:,.0f} MB" if path.is_file() else "not installed"
        table.add_row(name, model.description, size, str(path) if path.is_file() else "-")
    console.print(table)
    return 0
