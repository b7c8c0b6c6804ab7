"""Subcommands of the `verispec` command line, one module each."""
