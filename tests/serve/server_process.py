"""A real `octavo serve` process on 127.0.0.1 for the server tests, started and stopped as a user would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240.0
SHUTDOWN_TIMEOUT_S = 60.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path
    model: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = SHUTDOWN_TIMEOUT_S) -> int:
        """Send `sig` (if still running) and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"server did not exit {timeout}s after signal {sig}:\n{self.log()[-3000:]}") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(artifact: Path, log_dir: Path, *extra_args: str) -> ServerProcess:
    """`python -m octavo.cli serve ARTIFACT --port 0 ...` (the port the system picks, read from the line the
    server prints), returned once /health answers 200."""
    descriptor, name = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=log_dir)
    os.close(descriptor)
    log_path = Path(name)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "octavo.cli", "serve", str(artifact), "--port", "0",
               "--served-model-name", "test-model", "--threads", "1", *extra_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, "", log_path, "test-model")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode} during startup:\n{server.log()[-3000:]}")
        if not server.url:
            found = re.search(r"^serving \S+ on (http://127\.0\.0\.1:\d+) ", server.log(), re.MULTILINE)
            server.url = found.group(1) if found else ""
        if server.url:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
        time.sleep(0.25)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server did not answer /health within {STARTUP_TIMEOUT_S}s:\n{server.log()[-3000:]}")


@contextlib.contextmanager
def running_server(artifact: Path, log_dir: Path, *extra_args: str,
                   stop_signal: int = signal.SIGTERM) -> Iterator[ServerProcess]:
    """A server for the duration of the block; it must then exit 0 on `stop_signal`."""
    server = start_server(artifact, log_dir, *extra_args)
    try:
        yield server
    finally:
        code = server.stop(stop_signal)
        assert code == 0, f"server exited with {code} on signal {stop_signal}:\n{server.log()[-3000:]}"
        assert "Traceback" not in server.log(), server.log()[-5000:]


def running_small_server(artifact: Path, log_dir: Path) -> contextlib.AbstractContextManager[ServerProcess]:
    """running_server with a small KV pool (64 blocks) and 256-token sequences: enough for short prompts."""
    return running_server(artifact, log_dir, "--num-kv-blocks", "64", "--max-model-len", "256")


def scrape_metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (the Prometheus text format, comments dropped)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
    return values


async def stream_events(client: httpx.AsyncClient, url: str, body: dict, path: str = "/v1/completions",
                        stop_after: int | None = None, first_event: asyncio.Event | None = None) -> list:
    """POST a streaming request; its parsed `data:` events (the string "[DONE]" last).

    With `stop_after`, the connection is closed after that many events (a client walking away);
    `first_event` is set when the first event arrived.
    """
    events = []
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if first_event is not None:
                first_event.set()
            if stop_after is not None and len(events) >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return events
