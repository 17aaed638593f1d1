"""Helpers shared by the subcommands: engine options on the command line, console output."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from octavo.config import EngineConfig

# Piped output (a file, a log) has no terminal width; rich would assume 80 columns and wrap tables.
PIPED_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160
console = Console(highlight=False, soft_wrap=True, width=PIPED_WIDTH)
error_console = Console(stderr=True, highlight=False, soft_wrap=True, width=PIPED_WIDTH)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig options, as every command that runs the engine accepts them."""
    group = parser.add_argument_group("engine options")
    group.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    group.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks")
    group.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    group.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    group.add_argument("--backend", choices=["auto", "torch", "triton"], default=None)
    group.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "num_kv_blocks": args.num_kv_blocks,
        "preemption_mode": args.preemption_mode,
        "device": args.device,
        "backend": args.backend,
        "num_threads": args.threads,
    }
    options = {key: value for key, value in options.items() if value is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return EngineConfig(**options)
