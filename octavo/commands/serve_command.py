"""`octavo serve ARTIFACT`: the OpenAI-compatible HTTP server over one artifact, with every engine option."""

from __future__ import annotations

import argparse

from octavo.commands.common import add_engine_arguments, engine_config, error_console, run_worker_node
from octavo.errors import OctavoError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API")
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="answer 503 (Retry-After) when N requests are already waiting (default: no limit)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients send (default: the ARTIFACT argument)")
    parser.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                        help="on SIGTERM / Ctrl-C, seconds in-flight requests may finish before they are aborted")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from octavo.runtime.engine import LLMEngine
    from octavo.serve.app import build_app
    from octavo.serve.async_engine import AsyncEngine
    from octavo.serve.context import ServerSettings
    from octavo.serve.server import serve_app

    if args.max_waiting is not None and args.max_waiting < 0:
        raise OctavoError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.grace_period < 0:
        raise OctavoError(f"--grace-period must be >= 0, got {args.grace_period}")
    node_exit = run_worker_node(args)
    if node_exit is not None:
        return node_exit
    engine = LLMEngine(args.artifact, engine_config(args))
    settings = ServerSettings(model_name=args.served_model_name or args.artifact, api_key=args.api_key,
                              max_waiting=args.max_waiting, grace_period_s=args.grace_period)
    app = build_app(AsyncEngine(engine), settings)
    error_console.print(f"serving {settings.model_name} on http://{args.host}:{args.port} "
                        f"(OpenAI-compatible: /v1/completions, /v1/chat/completions; /health, /metrics)")
    if not serve_app(app, args.host, args.port, args.grace_period, getattr(args, "verbose", 0)):
        raise OctavoError(f"the server could not start on {args.host}:{args.port}")
    return 0
