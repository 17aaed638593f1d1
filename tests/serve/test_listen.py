"""Where `octavo serve` listens: a bad port is refused by the parser, an address it cannot bind is one error line
before the engine loads, and port 0 serves on the port the system picks, printed at start."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx

from tests.serve.server_process import running_server


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "octavo.cli", "serve", *args]


def test_a_port_outside_0_to_65535_is_refused_by_the_parser(tiny_llama_artifact):
    for port in ("65536", "-1", "http"):
        result = subprocess.run(serve_command(str(tiny_llama_artifact), "--port", port), capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert "argument --port:" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_port_in_use_is_one_error_line_before_the_artifact_is_read(tmp_path):
    """The artifact does not exist: the port's error, not the artifact's, shows that the socket came first."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(serve_command(str(tmp_path / "missing"), "--port", str(port)), capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_port_0_serves_on_the_port_it_prints(tiny_llama_artifact, tmp_path):
    """start_server passes --port 0 and reads the URL from the server's `serving ... on URL` line."""
    with running_server(tiny_llama_artifact, tmp_path) as server:
        assert int(server.url.rsplit(":", 1)[1]) != 0
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        completion = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert completion["usage"]["completion_tokens"] == 3, completion
