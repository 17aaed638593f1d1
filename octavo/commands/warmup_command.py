"""`octavo warmup`: build everything an engine compiles for this machine (the compiled executor) ahead of use."""

from __future__ import annotations

import argparse
import time

from octavo.commands.common import add_engine_arguments, console, engine_config, follow_engine
from octavo.runtime.sampling_params import SamplingParams

WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("warmup", help="compile an artifact's graph for this machine into the cache, "
                                   "so later engines start in seconds")
    parser.add_argument("artifact", help="artifact directory")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    warm_up(args.artifact, engine_config(args))
    return 0


def warm_up(artifact: str, config) -> float:
    """Load `artifact` as an engine with `config`, run one short request; print and return the seconds taken.

    The engine compiles its graph into the cache when it is not there yet (a
    cold start); the request pays each step shape's first-call costs. Every
    rank of a parallel engine compiles its own program; rank 0's is reported.
    """
    from octavo.parallel import create_engine

    start = time.perf_counter()
    engine = create_engine(artifact, config)
    engine.add_request(WARMUP_PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    executor = engine.parallel.state.executor if engine.parallel is not None else engine.executor
    engine.shutdown()
    if executor.kind == "compiled":
        how = (f"compiled the graph in {executor.compile_seconds:.1f}s (cold)" if executor.compile_seconds
               else f"loaded the compiled graph in {executor.load_seconds:.2f}s (warm)")
        console.print(f"{artifact}: {how}, cached at {executor.path}; load + warm-up {seconds:.1f}s "
                      f"({engine.device}, backend {engine.backend}, {_threads()} threads)")
    else:
        console.print(f"{artifact}: executor {engine.executor_kind}, nothing to compile; load + warm-up "
                      f"{seconds:.1f}s")
    return seconds


def _threads() -> int:
    import torch

    return torch.get_num_threads()
