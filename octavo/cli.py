"""The `octavo` command line: compile | generate | chat | inspect | bench | eval | warmup | demo | serve."""

from __future__ import annotations

import argparse
import logging
import sys

from octavo.errors import OctavoError
from octavo.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from octavo.commands import (
        bench_command,
        compile_command,
        eval_command,
        generate_command,
        inspect_command,
        serve_command,
        warmup_command,
    )

    parser = argparse.ArgumentParser(prog="octavo", description="Compile and serve causal language models.")
    parser.add_argument("--version", action="version", version=f"octavo {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compile_command.add_parser(subparsers)
    generate_command.add_parsers(subparsers)
    inspect_command.add_parser(subparsers)
    bench_command.add_parser(subparsers)
    eval_command.add_parser(subparsers)
    warmup_command.add_parser(subparsers)
    serve_command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    _quiet_third_party(args.verbose)
    try:
        return args.run(args)
    except OctavoError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _quiet_third_party(verbosity: int) -> None:
    if verbosity >= 2:
        return
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
