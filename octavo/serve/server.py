"""Running the app under uvicorn with a graceful shutdown.

On SIGTERM or Ctrl-C the server stops accepting connections, lets in-flight requests finish for the
grace period, aborts what is still running then (streams end with finish_reason "abort"), stops the
engine thread and returns. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from octavo.serve.app import begin_drain

logger = logging.getLogger(__name__)

SHUTDOWN_BACKSTOP_S = 10.0
"""Seconds uvicorn waits after the grace period before it cancels handlers that are still running."""


def serve_app(app: FastAPI, host: str, port: int, grace_period_s: float, verbose: int = 0) -> bool:
    """Serve `app` on host:port until SIGTERM / Ctrl-C; False when the server could not start."""
    config = uvicorn.Config(app, host=host, port=port, log_level="debug" if verbose >= 2 else "info",
                            access_log=verbose >= 1, timeout_graceful_shutdown=grace_period_s + SHUTDOWN_BACKSTOP_S,
                            timeout_keep_alive=5)
    server = GracefulServer(config, lambda: begin_drain(app, grace_period_s))
    with _signals_absorbed():
        server.run()
    return server.started


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
