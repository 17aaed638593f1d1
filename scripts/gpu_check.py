"""Run the GPU check's steps under one time budget and write one JSON summary (scripts/gpu_check.sh runs this).

Each step is a program (scripts/gpu_*.py, or pytest for the kernel tests) run in its own process group
with a timeout: the smaller of its cap and the time left before the budget ends (OCTAVO_GPU_CHECK_BUDGET
seconds from GPU_CHECK_STARTED, default 525 s on a GPU), so the whole check ends in time even when a
step hangs. A step that cannot get its minimum is recorded "not run: time". GPU_CHECK_STEPS (comma-separated
step names) runs only those steps and the steps they need, to split the check over several calls. The two
model preparations run in the background from the start. Steps run in the order of what matters most: correctness first,
then the figures. After every step the summary is rewritten (WORK/gpu_check.json, and $OUT/gpu_check.json
with the steps' logs in $OUT/gpu_check.log where OUT is set), so a check cut short still leaves it.
docs/gpu.md describes the summary. Exit status 0 when no step and no check failed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CUDA = os.environ.get("GPU_CHECK_DEVICE") == "cuda"
LOG_TAIL = 6000  # characters of each step's output kept in the summary
SUMMARY_RESERVE = 5.0  # seconds kept back to write the summary
DRY_RUN_SLOWER = 4  # the dry run's steps may take this many times their caps (Triton's interpreter, 2 CPU cores)


@dataclass
class Step:
    name: str
    argv: list[str]
    cap: float                      # longest it may run, seconds
    minimum: float = 10.0           # not started with less time left than this
    background: bool = False
    needs: tuple[str, ...] = ()     # must have passed
    after: tuple[str, ...] = ()     # must have ended (no CPU contention), pass or fail
    status: str = "pending"
    seconds: float = 0.0
    detail: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0
    timeout: float = 0.0
    cut_by_budget: bool = False  # its timeout is the time the budget had left, shorter than its cap


def script(name: str, *args: str) -> list[str]:
    return [PYTHON, str(REPO / "scripts" / name), *args]


def kernel_tests(work: Path) -> list[str]:
    argv = [PYTHON, "-m", "pytest", "tests/codegen/triton", "-m", "not slow", "-q", "-p", "no:cacheprovider",
            f"--junitxml={work / 'kernel_tests.xml'}"]
    if CUDA and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", "8"]  # Triton's compiles in parallel processes on one GPU
    return argv


def steps(work: Path) -> list[Step]:
    small, big = "smollm2-135m", "llama-3.1-8b"
    return [
        Step("versions and device ceilings", script("gpu_env.py"), cap=90),
        Step(f"prepare {small}", script("gpu_prepare.py", small), cap=240, background=True),
        Step(f"prepare {big}", script("gpu_prepare.py", big), cap=420, background=True),
        Step("Triton kernel tests" + ("" if CUDA else " (interpreter)"), kernel_tests(work), cap=240, minimum=30),
        Step("CUDA-graph ladder", script("gpu_cuda_graphs.py"), cap=150, minimum=20, needs=(f"prepare {small}",)),
        Step("engine step by step, tiny architectures", script("gpu_engines.py"), cap=240, minimum=30),
        Step(small, script("gpu_model_check.py", small), cap=150, minimum=30, needs=(f"prepare {small}",),
             after=(f"prepare {big}",)),
        Step("kernel timings", script("gpu_kernel_timings.py"), cap=90, minimum=15, after=(f"prepare {big}",)),
        Step(big, script("gpu_model_check.py", big), cap=480, minimum=60, needs=(f"prepare {big}",)),
    ]


def select(all_steps: list[Step], names: str) -> list[Step]:
    """The steps named in `names` (comma-separated; empty: all), the steps they need, and the first (versions)."""
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    if not wanted:
        return all_steps
    unknown = wanted - {step.name for step in all_steps}
    if unknown:
        raise SystemExit(f"gpu_check: unknown steps {sorted(unknown)}; the steps: {[s.name for s in all_steps]}")
    wanted.add(all_steps[0].name)
    for step in all_steps:
        if step.name in wanted:
            wanted.update(step.needs)
    return [step for step in all_steps if step.name in wanted]


class Check:
    def __init__(self, work: Path, budget: float, started: float):
        self.work, self.deadline, self.started = work, started + budget, started
        self.steps = select(steps(work), os.environ.get("GPU_CHECK_STEPS", ""))
        self.environment = step_environment(work)
        (work / "records").mkdir(parents=True, exist_ok=True)
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time() - SUMMARY_RESERVE

    def run(self) -> int:
        for step in self.steps:
            if step.background:
                self.start(step)
        for step in self.steps:
            if not step.background:
                self.run_foreground(step)
        for step in self.steps:
            self.wait(step)
        self.write_summary(final=True)
        self.print_table()
        return int(any(item["status"].startswith("failed") for item in self.summary()["checks"])
                   or any(step.status.startswith("failed") for step in self.steps))

    def run_foreground(self, step: Step) -> None:
        present = {other.name for other in self.steps}
        for name in step.needs:
            if name in present:
                self.wait(self.by_name(name))
        for name in step.after:  # worth waiting for only while this step keeps its minimum time
            if name in present:
                self.wait(self.by_name(name), until=self.deadline - SUMMARY_RESERVE - step.minimum)
        failed = [name for name in step.needs if self.by_name(name).status != "passed"]
        if failed:
            step.status = f"not run: {', '.join(failed)} did not pass"
        else:
            self.start(step)
            self.wait(step)
        self.write_summary()

    def by_name(self, name: str) -> Step:
        return next(step for step in self.steps if step.name == name)

    def start(self, step: Step) -> None:
        left = self.left()
        if left < step.minimum:
            step.status = "not run: time"
            return
        cap = step.cap * (1 if CUDA else DRY_RUN_SLOWER)
        step.timeout, step.cut_by_budget = min(cap, left), left < cap
        step.started = time.time()
        environment = {**self.environment, "GPU_CHECK_RECORDS": str(self.records(step)),
                       "GPU_CHECK_DEADLINE": str(step.started + step.timeout - 3)}
        log = open(self.log(step), "w")  # noqa: SIM115 (closed when the process ends, in wait)
        step.process = subprocess.Popen(step.argv, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        step.status = "running"
        print(f"[{time.time() - self.started:5.0f}s] {step.name}: started (timeout {step.timeout:.0f}s)", flush=True)

    def wait(self, step: Step, until: float | None = None) -> None:
        """Wait for a running step to end, or to time out (then stop it); with `until`, not past that time."""
        if step.process is None or step.status != "running":
            return
        # A background step may have ended long before: its log's last write is when.
        ended_before = step.process.poll() is not None
        limit = step.started + step.timeout
        try:
            code = step.process.wait(timeout=max(1.0, min(limit, until or limit) - time.time()))
            step.status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            if until is not None and until < limit:
                return  # still running, within its own time
            stop(step.process)
            step.status = (f"not finished: the budget ended after {step.timeout:.0f}s" if step.cut_by_budget
                           else f"failed: timed out after {step.timeout:.0f}s")
        ended = self.log(step).stat().st_mtime if ended_before else time.time()
        step.seconds = ended - step.started
        step.detail = self.step_detail(step)
        print(f"[{time.time() - self.started:5.0f}s] {step.name}: {step.status} in {step.seconds:.0f}s "
              f"{step.detail}", flush=True)

    def step_detail(self, step: Step) -> str:
        report = self.work / "kernel_tests.xml"
        if step.argv[1:3] == ["-m", "pytest"] and report.is_file():
            return junit_counts(report)
        return ""

    def records(self, step: Step) -> Path:
        return self.work / "records" / f"{slug(step.name)}.jsonl"

    def log(self, step: Step) -> Path:
        return self.work / "logs" / f"{slug(step.name)}.log"

    def summary(self) -> dict:
        checks, figures, versions = [], [], {}
        for step in self.steps:
            path = self.records(step)
            lines = path.read_text().splitlines() if path.is_file() else []
            for item in (json.loads(line) for line in lines if line.strip()):
                kind = item.pop("kind")
                if kind == "versions":
                    versions = item
                else:
                    (checks if kind == "check" else figures).append({"step": step.name, **item})
        return {
            "mode": "gpu" if CUDA else "dry run (CPU, Triton interpreter, tiny sizes)",
            "budget_s": round(self.deadline - self.started), "wall_s": round(time.time() - self.started, 1),
            "versions": versions,
            "steps": [{"name": step.name, "status": step.status, "seconds": round(step.seconds, 1),
                       "timeout_s": round(step.timeout), "detail": step.detail} for step in self.steps],
            "checks": checks, "figures": figures,
        }

    def write_summary(self, final: bool = False) -> None:
        summary = self.summary()
        summary["complete"] = final
        text = json.dumps(summary, indent=1)
        targets = [self.work / "gpu_check.json"]
        if os.environ.get("OUT"):
            targets.append(Path(os.environ["OUT"]) / "gpu_check.json")
            self.write_logs(Path(os.environ["OUT"]) / "gpu_check.log")
        for path in targets:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_suffix(".tmp")
            staging.write_text(text)
            os.replace(staging, path)

    def write_logs(self, path: Path) -> None:
        parts = []
        for step in self.steps:
            log = self.log(step)
            if log.is_file():
                text = log.read_text(errors="replace")
                parts.append(f"===== {step.name}: {step.status}\n{text[-LOG_TAIL * 4:]}")
        path.write_text("\n".join(parts))

    def print_table(self) -> None:
        summary = self.summary()
        print(f"\n== GPU check, {summary['mode']}: {summary['wall_s']:.0f}s of a {summary['budget_s']}s budget")
        versions = summary["versions"]
        if versions:
            print("   " + ", ".join(f"{key} {value}" for key, value in versions.items()))
        print("\n-- steps")
        for step in summary["steps"]:
            print(f"   {step['status']:<34.34} {step['seconds']:6.0f}s  {step['name']} {step['detail']}")
        print("\n-- checks")
        for item in summary["checks"]:
            print(f"   {item['status']:<18.18} {item['name']}: {item.get('detail', '')}")
        print("\n-- figures (value; ratio: what it is read as; target)")
        for item in summary["figures"]:
            if "status" in item:
                print(f"   {item['name']}: {item['status']}")
                continue
            ratio = f"; ratio {item['ratio']:.3g} ({item['ratio_of']})" if item.get("ratio") is not None else ""
            target = f"; target {item['target']}" if item.get("target") else ""
            print(f"   {item['name']}: {item['value']:.4g} {item['unit']}{ratio}{target}")


def stop(process: subprocess.Popen) -> None:
    """End a step's process group (this check started it in a session of its own)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def junit_counts(path: Path) -> str:
    """'N passed, F failed, E errors, S skipped' and the first failing tests, from pytest's JUnit XML."""
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped"))
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    text = f"{tests - failures - errors - skipped} passed, {failures} failed, {errors} errors, {skipped} skipped"
    return text + (f"; failing: {', '.join(failing[:8])}" if failing else "")


def slug(name: str) -> str:
    return "".join(character if character.isalnum() else "-" for character in name).strip("-")


def step_environment(work: Path) -> dict[str, str]:
    environment = dict(os.environ)
    environment.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")])),
        GPU_CHECK_WORK=str(work), OCTAVO_CACHE_DIR=str(work / "cache"),
        TRITON_CACHE_DIR=str(work / "cache" / "triton"),  # shared by every step, as an engine would set it
        OCTAVO_TEST_DEVICE="cuda" if CUDA else "cpu", OCTAVO_TEST_TOKENIZER="generated",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
    )
    if CUDA:
        environment.pop("TRITON_INTERPRET", None)
    else:
        environment["TRITON_INTERPRET"] = "1"
    return environment


def main() -> int:
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    budget = float(os.environ.get("OCTAVO_GPU_CHECK_BUDGET") or (525 if CUDA else 1800))
    work = Path(os.environ.get("GPU_CHECK_WORK") or tempfile.mkdtemp(prefix="octavo-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"GPU check: {'CUDA' if CUDA else 'dry run on the CPU'}, budget {budget:.0f}s, work dir {work}", flush=True)
    return Check(work, budget, started).run()


if __name__ == "__main__":
    sys.exit(main())
