"""Implementations of the `octavo` subcommands (the parser lives in octavo/cli.py)."""
