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
    group.add_argument("--backend", choices=["auto", "torch", "triton", "cpu"], default=None)
    group.add_argument("--executor", choices=["auto", "compiled", "eager"], default=None,
                       help="compiled: the graph compiled ahead of time (CPU; CUDA graphs on CUDA), cached per "
                       "machine; eager: node by node; auto (default): compiled where it can be built")
    group.add_argument("--threads", type=int, default=None, help="torch CPU threads (per rank)")
    group.add_argument("--speculative", metavar="SPEC", default=None,
                       help="speculative decoding: ngram:K (prompt lookup) or draft:PATH:K (a draft artifact with "
                       "the same tokenizer) proposes up to K tokens per step; add :fixed to always propose K "
                       "(default: a measured cost model picks K, down to none)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="PEFT LoRA adapters to load at start (an artifact compiled with LoRA); requests pick "
                       "one by its NAME in the model field")
    group.add_argument("--max-loras", type=int, default=None, help="LoRA adapter slots (default 4)")
    parallel = parser.add_argument_group("parallel options")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                          help="shard each layer over N ranks (attention heads, MLP columns, vocabulary)")
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="P",
                          help="split the layers into P pipeline stages")
    parallel.add_argument("--distributed-executor", choices=["auto", "mp", "ray"], default=None,
                          help="who starts the ranks: mp (this machine's ranks as processes), ray (an actor per "
                          "rank on a Ray cluster: pip install 'octavo[ray]'), auto (default): the launcher that "
                          "started this process (torchrun, srun) when there is one, else mp")
    parallel.add_argument("--distributed-init", default=None, metavar="tcp://HOST:PORT",
                          help="mp over several machines: the rendezvous (node 0 listens there)")
    parallel.add_argument("--nnodes", type=int, default=None, help="mp: machines the ranks are spread over")
    parallel.add_argument("--node-rank", type=int, default=None,
                          help="mp: this machine's index; node 0 runs the engine, the others only worker ranks")
    parallel.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                          help="seconds a rank waits on another within a step before the engine stops")
    parallel.add_argument("--rendezvous-timeout", type=float, default=None, metavar="S",
                          help="seconds the ranks wait for each other at start-up (default 600: they load and "
                          "may compile their programs)")


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
        "executor": args.executor,
        "num_threads": args.threads,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "distributed_init": args.distributed_init,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "collective_timeout": args.collective_timeout,
        "rendezvous_timeout": args.rendezvous_timeout,
        "distributed_executor": args.distributed_executor,
        "speculative": args.speculative,
        "lora_modules": tuple(args.lora_modules) if args.lora_modules else None,
        "max_loras": args.max_loras,
    }
    options = {key: value for key, value in options.items() if value is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return EngineConfig(**options)


def follow_engine(args: argparse.Namespace) -> int | None:
    """When this process is not rank 0 of its engine, run its ranks until the engine stops; else None.

    Under torchrun or srun, ranks other than 0 run their rank program here; with
    --node-rank R > 0, this machine starts its ranks and waits for them.
    """
    from octavo.parallel import follow

    config = engine_config(args)
    if config.node_rank > 0:
        error_console.print(f"node {config.node_rank} of {config.nnodes}: worker ranks of {args.artifact} "
                            f"(rendezvous {config.distributed_init})")
    return follow(args.artifact, config)


def create_engine(args: argparse.Namespace, config: EngineConfig | None = None):
    """The engine of a command (rank 0 of a parallel engine, or a single process)."""
    from octavo.parallel import create_engine as create

    return create(args.artifact, config or engine_config(args))


def number_at_least(minimum: float, kind: type = int, exclusive: bool = False, finite: bool = True):
    """An argparse type: a `kind` number >= `minimum` (> with `exclusive`; infinity only without `finite`),
    refused with the bound in the message. NaN is never a number here."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if value != value or (finite and value in (float("inf"), float("-inf"))):
            raise argparse.ArgumentTypeError(f"not a finite number: {text!r}" if finite else f"not a number: {text!r}")
        if value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if exclusive else '>='} {minimum}, got {text}")
        return value

    return parse
