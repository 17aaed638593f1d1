"""`octavo generate --tensor-parallel-size 2` whose worker is killed mid-run: a clear error and a non-zero exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

TIMEOUT_S = 20.0


def test_generate_names_the_killed_rank_and_exits_non_zero(tiny_artifact):
    command = [sys.executable, "-m", "octavo.cli", "generate", str(tiny_artifact("llama")), "--prompt", "Hello",
               "--max-tokens", "480", "--tensor-parallel-size", "2", "--threads", "1",
               "--collective-timeout", str(TIMEOUT_S)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout.read(1), "no text was generated"  # the engine is stepping
        worker = next(child for child in psutil.Process(process.pid).children()
                      if "octavo.parallel.worker" in child.cmdline())
        worker.send_signal(signal.SIGKILL)
        start = time.monotonic()
        _, stderr = process.communicate(timeout=TIMEOUT_S + 30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert time.monotonic() - start < TIMEOUT_S + 30
    assert process.returncode == 1
    assert "error: distributed engine stopped" in stderr.decode()
    assert "rank 1 was killed by signal SIGKILL" in stderr.decode()
