"""Running the app under uvicorn with a graceful shutdown.

On SIGTERM or Ctrl-C the server stops accepting connections, lets in-flight requests finish for the
grace period, aborts what is still running then (streams end with finish_reason "abort"), stops the
engine thread and returns. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from octavo.errors import OctavoError
from octavo.serve.app import begin_drain

logger = logging.getLogger(__name__)

SHUTDOWN_BACKSTOP_S = 10.0
"""Seconds uvicorn waits after the grace period before it cancels handlers that are still running."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: one the system picks), for serve_app to accept on.

    The command binds it before it loads the engine, so that a port already in use or a host this
    machine does not have is one error line at once, not after the model has loaded. It does not
    listen yet: until the server starts, a client is refused rather than left waiting in the backlog.
    """
    # As uvicorn binds a socket it is given a host for: IPv6 for an address with colons, else IPv4 (a name
    # such as localhost resolves to its IPv4 address).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A server restarted at once must not wait for its predecessor's closed connections to time out.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OctavoError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def socket_url(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket (the port the system picked for port 0; IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def serve_app(app: FastAPI, sock: socket.socket, grace_period_s: float, verbose: int = 0) -> bool:
    """Serve `app` on the bound socket `sock` until SIGTERM / Ctrl-C; False when the server could not start."""
    config = uvicorn.Config(app, log_level="debug" if verbose >= 2 else "info",
                            access_log=verbose >= 1, timeout_graceful_shutdown=grace_period_s + SHUTDOWN_BACKSTOP_S,
                            timeout_keep_alive=5)
    server = GracefulServer(config, lambda: begin_drain(app, grace_period_s))
    with _signals_absorbed():
        server.run(sockets=[sock])
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
