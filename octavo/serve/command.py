"""`octavo serve ARTIFACT`: the OpenAI-compatible HTTP server (uvicorn), with graceful shutdown.

On SIGTERM or Ctrl-C the server stops accepting connections, lets in-flight requests finish for
`--grace-period` seconds, aborts what is still running then (streams end with finish_reason
"abort"), stops the engine thread and exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import contextmanager

import uvicorn

from octavo.commands.common import add_engine_arguments, engine_config, error_console, run_worker_node
from octavo.errors import OctavoError

logger = logging.getLogger(__name__)

SHUTDOWN_BACKSTOP_S = 10.0
"""Seconds uvicorn waits after the grace period before it cancels handlers that are still running."""


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
    from octavo.serve.app import begin_drain, build_app
    from octavo.serve.async_engine import AsyncEngine
    from octavo.serve.context import ServerSettings

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
    verbose = getattr(args, "verbose", 0)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="debug" if verbose >= 2 else "info",
                            access_log=verbose >= 1, timeout_graceful_shutdown=args.grace_period + SHUTDOWN_BACKSTOP_S,
                            timeout_keep_alive=5)
    server = GracefulServer(config, lambda: begin_drain(app, args.grace_period))
    error_console.print(f"serving {settings.model_name} on http://{args.host}:{args.port} "
                        f"(OpenAI-compatible: /v1/completions, /v1/chat/completions; /health, /metrics)")
    with _signals_absorbed():
        server.run()
    if not server.started:
        raise OctavoError(f"the server could not start on {args.host}:{args.port}")
    return 0


class GracefulServer(uvicorn.Server):
    """A uvicorn.Server that also tells the app, on the first exit signal, to start draining."""

    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None]):
        super().__init__(config)
        self.on_first_signal = on_first_signal
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_first_signal)
        super().handle_exit(sig, frame)


@contextmanager
def _signals_absorbed():
    """Install no-op SIGINT/SIGTERM handlers around uvicorn's own.

    uvicorn restores the handlers it found and re-raises the signal that stopped it, so that the
    process dies of it; with these in place the re-raised signal does nothing and the command
    returns 0 after its graceful shutdown.
    """
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(sig: int, frame) -> None:
    logger.debug("signal %d after shutdown ignored", sig)
