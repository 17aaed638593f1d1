"""Artifacts a test session builds in subprocesses, one after another, while its other tests run.

Compiling the bundled model is mostly single-threaded Python (tracing, passes, writing the artifact), so on a
2-core machine it can use the CPU time the tests leave idle (waiting on servers and subprocesses, one core
busy with Python) instead of running before the tests that need it. conftest declares each build with the
session fixture that returns it; once the session's tests are collected, the builds whose fixture some collected
test needs start in a queue: one subprocess at a time, one torch thread, at the idle scheduling class (SCHED_IDLE,
else nice 19), so that it never takes a core from the tests (measured: at normal priority it slowed the suite's
two-threaded tests by more than it saved). The fixture waits for its build, starting it at once if the queue has
not reached it yet; while the tests wait, the build has the CPU. A build's subprocess is exactly what a user or
the test would run: `octavo compile`, or a module of this package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BackgroundBuild:
    """One subprocess (`argv`, with `environment` added to the session's) writing into `directory`; its output is
    kept in `directory`/stdout.log, stderr.log."""

    name: str
    argv: list[str]
    directory: Path
    environment: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    _start: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _process: subprocess.Popen | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _stopped: bool = False

    def run(self) -> None:
        """Start the subprocess (unless it has started or the session stopped) and wait for it."""
        with self._lock:
            if self._process is None and not self._stopped:
                self.directory.mkdir(parents=True, exist_ok=True)
                # One torch thread: the tests running beside it keep the other core.
                environment = {**os.environ, "OMP_NUM_THREADS": "1", **self.environment}
                start = time.perf_counter()
                with open(self.directory / "stdout.log", "w") as stdout, \
                        open(self.directory / "stderr.log", "w") as stderr:
                    self._process = subprocess.Popen([*_idle_priority(), *self.argv], stdout=stdout, stderr=stderr,
                                                     env=environment, text=True)
                self._start = start
            process = self._process
        if process is not None:
            process.wait()
            self.seconds = time.perf_counter() - self._start
        self._done.set()

    def result(self, timeout: float = 3600) -> subprocess.CompletedProcess:
        """The finished subprocess (run now if the queue has not started it), with its output."""
        if self._process is None:
            self.run()
        if not self._done.wait(timeout):
            raise TimeoutError(f"background build {self.name} did not finish in {timeout:.0f} s")
        if self._process is None:
            raise RuntimeError(f"background build {self.name} was stopped before it started")
        return subprocess.CompletedProcess(self.argv, self._process.returncode,
                                           (self.directory / "stdout.log").read_text(),
                                           (self.directory / "stderr.log").read_text())

    def stop(self) -> None:
        """Kill the subprocess if it still runs, and start nothing more."""
        with self._lock:
            self._stopped = True
            if self._process is not None and self._process.poll() is None:
                self._process.kill()
                self._process.wait()
        self._done.set()


def _idle_priority() -> list[str]:
    """The command prefix that runs a command on CPU time nothing else wants (chrt --idle), else at nice 19."""
    if shutil.which("chrt"):
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", "19"] if shutil.which("nice") else []


class BuildQueue:
    """Runs its builds one after another on a daemon thread."""

    def __init__(self, builds: list[BackgroundBuild]) -> None:
        self.builds = {build.name: build for build in builds}
        self._thread = threading.Thread(target=self._run_all, name="background-builds", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run_all(self) -> None:
        for build in self.builds.values():
            build.run()

    def stop(self) -> None:
        for build in self.builds.values():
            build.stop()
