"""`octavo serve ARTIFACT`: the OpenAI-compatible HTTP server over one artifact, with every engine option."""

from __future__ import annotations

import argparse

from octavo.commands.common import add_engine_arguments, create_engine, error_console, follow_engine
from octavo.errors import OctavoError
from octavo.serve.defaults import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_WORKERS
from octavo.serve.stream import DEFAULT_MAX_BACKLOG


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an artifact over an OpenAI-compatible HTTP API")
    parser.add_argument("artifact", help="artifact directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000,
                        help="port to listen on (default 8000; 0: one the system picks, printed at start)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="answer 503 (Retry-After) when N requests are already waiting (default: no limit by "
                             "count; the token limit below always applies)")
    parser.add_argument("--max-waiting-tokens", type=int, default=None, metavar="T",
                        help="answer 503 (Retry-After) when the prompts waiting to start would hold more than T "
                             "tokens (default: the KV pool's token slots, num_kv_blocks x block_size: more than "
                             "one full pool could not start even if everything running finished)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="B",
                        help=f"answer 413 to a request body over B bytes, before reading it "
                             f"(default {DEFAULT_MAX_REQUEST_BYTES} = {DEFAULT_MAX_REQUEST_BYTES // 2**20} MiB)")
    parser.add_argument("--tokenizer-threads", type=int, default=DEFAULT_WORKERS, metavar="N",
                        help=f"threads that tokenize prompts, beside the engine thread (default {DEFAULT_WORKERS})")
    parser.add_argument("--max-stream-backlog", type=int, default=DEFAULT_MAX_BACKLOG, metavar="E",
                        help=f"abort a streaming request, with an error event, when its client falls E entries "
                             f"behind (a token is one entry, plus one per logprob alternative; default "
                             f"{DEFAULT_MAX_BACKLOG})")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients send (default: the ARTIFACT argument)")
    parser.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral"],
                        help="the format tool calls are read in when tool_choice is auto: hermes (<tool_call>, "
                        "Hermes and Qwen), llama3_json, mistral ([TOOL_CALLS]); auto (default) picks it from the "
                        "chat template")
    parser.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                        help="on SIGTERM / Ctrl-C, seconds in-flight requests may finish before they are aborted")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from octavo.serve.app import build_app
    from octavo.serve.async_engine import AsyncEngine
    from octavo.serve.context import ServerSettings
    from octavo.serve.server import bind_listening_socket, serve_app, socket_url

    for option in ("max_waiting", "max_waiting_tokens", "max_request_bytes", "max_stream_backlog", "tokenizer_threads"):
        value = getattr(args, option)
        if value is not None and value < (0 if option == "max_waiting" else 1):
            flag = "--" + option.replace("_", "-")
            raise OctavoError(f"{flag} must be >= {0 if option == 'max_waiting' else 1}, got {value}")
    if not args.grace_period >= 0:  # NaN too
        raise OctavoError(f"--grace-period must be >= 0, got {args.grace_period}")
    follower_exit = follow_engine(args)
    if follower_exit is not None:
        return follower_exit
    with bind_listening_socket(args.host, args.port) as sock:
        engine = create_engine(args)
        try:
            settings = ServerSettings(model_name=args.served_model_name or args.artifact, api_key=args.api_key,
                                      max_waiting=args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
                                      max_request_bytes=args.max_request_bytes,
                                      tokenizer_threads=args.tokenizer_threads, grace_period_s=args.grace_period,
                                      tool_call_parser=args.tool_call_parser)
            app = build_app(AsyncEngine(engine, args.max_stream_backlog), settings)
            error_console.print(f"serving {settings.model_name} on {socket_url(sock)} "
                                f"(OpenAI-compatible: /v1/completions, /v1/chat/completions; /health, /metrics)")
            if not serve_app(app, sock, args.grace_period, getattr(args, "verbose", 0)):
                raise OctavoError(f"the server could not start on {args.host}:{args.port}")
        finally:
            engine.shutdown()  # a parallel engine's other ranks (other nodes' too) end with it
    return 0


def _port(text: str) -> int:
    """A TCP port number for argparse: 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {port}")
    return port
