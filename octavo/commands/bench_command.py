"""`octavo bench`: fixed workloads on an artifact, optionally side by side with Hugging Face.

The parser only; the run is octavo.commands.bench_run, imported when the command runs (building the
parser for another command, or for --help, loads no engine)."""

from __future__ import annotations

import argparse

from octavo.commands.common import add_engine_arguments, number_at_least


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark an artifact on a fixed workload")
    parser.add_argument("artifact", nargs="?", help="artifact directory (with --server: optional, for its tokenizer)")
    parser.add_argument("--workload", default="throughput", help="throughput | single | shared_prefix | copy")
    parser.add_argument("--prompts-from", metavar="FILE", default=None,
                        help="run these requests instead of --workload: a JSON list of {\"prompt_token_ids\": "
                        "[...], \"max_tokens\": N}, as the side-by-side harness of other engines writes it")
    parser.add_argument("--vs", choices=["hf", "no-prefix-caching", "full-pool", "no-speculation", "unconstrained"],
                        default=None,
                        help="also run a baseline in this process and print the ratio: Hugging Face generate, "
                        "the engine without prefix caching, with a pool that holds every request, without "
                        "speculative decoding, or (a workload with a schema) the same requests unconstrained, "
                        "each generating as many tokens as its constrained twin")
    parser.add_argument("--vs-artifact", metavar="DIR", default=None,
                        help="also run the workload on this second artifact (e.g. compiled with --disable-pass) "
                        "in this process and print the ratio")
    parser.add_argument("--kv-pool-fraction", type=number_at_least(0.0, float, exclusive=True), default=None,
                        metavar="F",
                        help="size the KV pool to F x the blocks the whole workload needs at once (e.g. 0.25)")
    parser.add_argument("--num-requests", type=number_at_least(1), default=None,
                        help="override the workload's request count")
    parser.add_argument("--lora-mix", type=number_at_least(0), default=0, metavar="K",
                        help="send the requests under the first K LoRA adapters the engine has loaded, in turn "
                        "(an artifact compiled with LoRA); compare with --vs-artifact BASE (the model without LoRA)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of a workload, split one decode step at 1 and at 64 sequences and one "
                        "512-token prefill into scheduling, input building, model (linears, attention, other "
                        "kernels, dispatch), sampling and detokenization; with --workload json_schema also a "
                        "64-sequence decode step under that schema (its grammar phase: waiting for the masks)")
    parser.add_argument("--server", metavar="URL", help="benchmark a running `octavo serve` (or any OpenAI-compatible "
                        "server) online: streaming requests with Poisson arrivals")
    parser.add_argument("--rate", type=number_at_least(0.0, float, exclusive=True, finite=False), default=float("inf"),
                        help="with --server: requests/s (default inf)")
    parser.add_argument("--model", help="with --server: the model name to send (default: the server's first)")
    parser.add_argument("--api-key", help="with --server: sent as 'Authorization: Bearer KEY'")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from octavo.commands.bench_run import run_bench

    return run_bench(args)
