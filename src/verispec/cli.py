"""The `verispec` command. Each subcommand lives in the module that implements it."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from verispec.errors import VerispecError

# module that defines `register(subparsers)`; its parsers set `func`
COMMAND_MODULES = [
    "verispec.commands.models",
    "verispec.commands.generate",
    "verispec.commands.bench",
    "verispec.commands.sweep",
    "verispec.commands.report",
    "verispec.commands.audit",
    "verispec.commands.demo",
    "verispec.commands.calibrate",
    "verispec.commands.explain",
    "verispec.commands.serve",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # bad options: one line and exit 2, as argparse does, no usage dump
        self.exit(2, f"verispec: error: {message}\n(see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Speculative decoding that never changes the answer.")
    parser.add_argument("--version", action="version", version=f"verispec {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from verispec import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    _show_notices()
    try:
        return int(args.func(args) or 0)
    except VerispecError as exc:
        print(f"verispec: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("verispec: error: out of memory; try a smaller model, --weights int8 or a shorter context",
              file=sys.stderr)
        return 1


class _Notices(logging.Handler):
    """Prints verispec's log records on whatever sys.stderr is at the time, one line each."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"verispec: {self.format(record)}", file=sys.stderr)


def _show_notices() -> None:
    """verispec's own notices (a first, slow load of a model file, say) on stderr."""
    logger = logging.getLogger("verispec")
    if not any(isinstance(handler, _Notices) for handler in logger.handlers):
        logger.addHandler(_Notices())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # not twice where the root logger has a handler too


if __name__ == "__main__":
    sys.exit(main())
