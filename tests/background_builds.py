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

Under pytest-xdist the workers leave no idle CPU to wait for, and a build starved until a test blocks on it
holds that test's worker for minutes: there every build starts at once, at normal priority. Every worker collects
the same tests and runs the same queue over one shared directory: each build runs once, in the worker that claims
it first (an exclusively created file), and the others wait for the exit file it leaves. A worker whose tests are
done still waits for the builds it started (another worker may need them) unless the session was interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CLAIM = "claimed"  # created exclusively by the process that runs the build
EXIT = "exit.json"  # {"returncode": int, "seconds": float}, written when the build ended
POLL_SECONDS = 0.5
FINISH_SECONDS = 1800  # the longest a worker whose tests are done waits for a build it started


@dataclass
class BackgroundBuild:
    """One subprocess (`argv`, with `environment` added to the session's) writing into `directory`; its output is
    kept in `directory`/stdout.log, stderr.log."""

    name: str
    argv: list[str]
    directory: Path
    environment: dict[str, str] = field(default_factory=dict)
    idle: bool = True  # at the idle scheduling class, else at normal priority
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _exit_lock: threading.Lock = field(default_factory=threading.Lock)
    _process: subprocess.Popen | None = None
    _started: float = 0.0
    _stopped: bool = False

    def run(self) -> None:
        """Start the subprocess unless this or another process of the session started it (or this one stopped),
        then wait until the build has ended, wherever it runs."""
        with self._lock:
            if self._process is None and not self._stopped and self._claim():
                self._start()
            process = self._process
        if process is not None:
            self._write_exit(process.wait())
        self._wait_for_exit()

    def result(self, timeout: float = 3600) -> subprocess.CompletedProcess:
        """The finished subprocess (run now if no queue has started it), with its output."""
        if self.stopped and not (self.directory / CLAIM).exists():
            raise RuntimeError(f"background build {self.name} was stopped before it started")
        waiter = threading.Thread(target=self.run, daemon=True)
        waiter.start()
        waiter.join(timeout)
        if waiter.is_alive():
            raise TimeoutError(f"background build {self.name} did not finish in {timeout:.0f} s")
        ended = json.loads((self.directory / EXIT).read_text())
        self.seconds = ended["seconds"]
        return subprocess.CompletedProcess(self.argv, ended["returncode"],
                                           (self.directory / "stdout.log").read_text(),
                                           (self.directory / "stderr.log").read_text())

    @property
    def stopped(self) -> bool:
        """Whether this process will start nothing more for this build."""
        return self._stopped

    def stop(self, kill: bool) -> None:
        """Start nothing more; kill the subprocess this process started if it still runs and `kill`, else let
        it finish (another process of the session may be waiting for it)."""
        with self._lock:
            self._stopped = True
            process = self._process
        if process is not None and process.poll() is None:
            if not kill:
                try:
                    process.wait(timeout=FINISH_SECONDS)
                except subprocess.TimeoutExpired:
                    kill = True
            if kill:
                process.kill()
            self._write_exit(process.wait())

    def _claim(self) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.directory / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _start(self) -> None:
        # One torch thread: the tests running beside it keep the other core.
        environment = {**os.environ, "OMP_NUM_THREADS": "1", **self.environment}
        self._started = time.perf_counter()
        with open(self.directory / "stdout.log", "w") as stdout, open(self.directory / "stderr.log", "w") as stderr:
            priority = _idle_priority() if self.idle else []
            self._process = subprocess.Popen([*priority, *self.argv], stdout=stdout, stderr=stderr,
                                             env=environment, text=True)

    def _write_exit(self, returncode: int) -> None:
        with self._exit_lock:
            exit_file = self.directory / EXIT
            if exit_file.exists():
                return
            staged = self.directory / f".{EXIT}.{os.getpid()}"
            seconds = time.perf_counter() - self._started
            staged.write_text(json.dumps({"returncode": returncode, "seconds": seconds}))
            os.replace(staged, exit_file)

    def _wait_for_exit(self) -> None:
        """Wait for the exit file of a build that was claimed; return at once for one nobody claimed (stopped)."""
        while (self.directory / CLAIM).exists() and not (self.directory / EXIT).exists():
            time.sleep(POLL_SECONDS)


def _idle_priority() -> list[str]:
    """The command prefix that runs a command on CPU time nothing else wants (chrt --idle), else at nice 19."""
    if shutil.which("chrt"):
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", "19"] if shutil.which("nice") else []


class BuildQueue:
    """Runs its builds on daemon threads: one after another at idle priority, or (`alongside_workers`, under
    pytest-xdist) all at once at normal priority. A build another process claimed is waited for."""

    def __init__(self, builds: list[BackgroundBuild], alongside_workers: bool = False) -> None:
        self.builds = {build.name: build for build in builds}
        for build in builds:
            build.idle = not alongside_workers
        runs = [[build] for build in builds] if alongside_workers else [builds]
        self._threads = [threading.Thread(target=self._run_all, args=(run,), name="background-builds", daemon=True)
                         for run in runs]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _run_all(builds: list[BackgroundBuild]) -> None:
        for build in builds:
            if build.stopped:
                return
            build.run()

    def stop(self, kill: bool) -> None:
        for build in self.builds.values():
            build.stop(kill)
