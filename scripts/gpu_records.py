"""What every step of scripts/gpu_check.py shares: its records, the device, the sizes, the step's deadline.

A step is a program that appends one JSON line per result to the file named by
GPU_CHECK_RECORDS (printed as well): a check ({"kind": "check", "name",
"status": "passed" | "failed" | "not run: ...", "seconds", "detail"}) or a
figure ({"kind": "figure", "name", "value", "unit", "ratio", "ratio_of",
"target", "detail"}). Without a CUDA device every step runs as the dry run:
the same code at tiny sizes on the CPU (Triton kernels in its interpreter).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

# GPU_CHECK_DEVICE=cpu asks for the dry run on a machine with a GPU too.
CUDA = torch.cuda.is_available() and os.environ.get("GPU_CHECK_DEVICE", "cuda") == "cuda"
DRY_RUN = not CUDA
if DRY_RUN:  # @triton.jit reads it when a kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(2)
DEVICE = torch.device("cuda" if CUDA else "cpu")
RECORDS_ENV, WORK_ENV, DEADLINE_ENV = "GPU_CHECK_RECORDS", "GPU_CHECK_WORK", "GPU_CHECK_DEADLINE"

# Config overrides of the model shapes in the dry run: two small layers, the shape's vocabulary and tying.
DRY_SHAPES = {
    "smollm2-135m": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16),
    "llama-3.1-8b": dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16),
}


def work_dir() -> Path:
    """The check's scratch directory (models, artifacts), shared by its steps."""
    path = Path(os.environ.get(WORK_ENV) or Path.cwd() / ".gpu-check")
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_dir(shape: str) -> Path:
    (work_dir() / "models").mkdir(exist_ok=True)
    return work_dir() / "models" / shape


def artifact_dir(shape: str) -> Path:
    (work_dir() / "artifacts").mkdir(exist_ok=True)
    return work_dir() / "artifacts" / shape


def engine_config(shape: str):
    """The engine of a model shape's figures: triton backend, decode steps as CUDA graphs, room for 256 sequences
    of the throughput workload (dry run: the interpreter, eager, small)."""
    from octavo.config import EngineConfig

    if DRY_RUN:
        return EngineConfig(device="cpu", backend="triton", executor="eager", max_num_seqs=8,
                            max_num_batched_tokens=256, max_model_len=512, num_kv_blocks=256)
    return EngineConfig(device="cuda", backend="triton", executor="compiled", max_num_seqs=256,
                        max_num_batched_tokens=8192, max_model_len=4096,
                        kv_cache_memory="32GiB" if shape == "llama-3.1-8b" else "8GiB")


def seconds_left() -> float:
    """Seconds until this step must end (GPU_CHECK_DEADLINE, an epoch time), or a day when unset."""
    deadline = os.environ.get(DEADLINE_ENV)
    return float(deadline) - time.time() if deadline else 86400.0


def record(**fields) -> None:
    line = json.dumps(fields, default=str)
    print(line, flush=True)
    path = os.environ.get(RECORDS_ENV)
    if path:
        with open(path, "a") as handle:
            handle.write(line + "\n")


def check(name: str, passed: bool, detail: str = "", seconds: float | None = None) -> bool:
    record(kind="check", name=name, status="passed" if passed else "failed", detail=detail,
           seconds=None if seconds is None else round(seconds, 2))
    return passed


def not_run(name: str, reason: str, kind: str = "check") -> None:
    record(kind=kind, name=name, status=f"not run: {reason}")


def figure(name: str, value: float, unit: str, ratio: float | None = None, ratio_of: str = "", target: str = "",
           detail: str = "") -> None:
    record(kind="figure", name=name, value=_rounded(value), unit=unit,
           ratio=None if ratio is None else _rounded(ratio), ratio_of=ratio_of, target=target, detail=detail)


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


@contextmanager
def checking(name: str):
    """Run a check's body: an exception records it as failed (with the error), else the body records it."""
    start = time.perf_counter()
    try:
        yield
    except Exception as error:  # one broken check must not hide the next
        traceback.print_exc()
        check(name, False, f"{type(error).__name__}: {error}"[:600], time.perf_counter() - start)


def ceilings() -> tuple[float, float]:
    """This device's copy bandwidth (bytes/s, read + written) and bf16 matmul rate (FLOP/s), measured now."""
    from octavo.bench.roofline import copy_bandwidth, matmul_flops

    return (copy_bandwidth(DEVICE, 2**30 if CUDA else 2**26),
            matmul_flops(DEVICE, torch.bfloat16, 8192 if CUDA else 512))


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def exit_status() -> int:
    """1 if any check of this step failed (read back from the records file), else 0."""
    path = os.environ.get(RECORDS_ENV)
    if not path or not Path(path).is_file():
        return 0
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return int(any(item.get("status") == "failed" for item in records))


def main_guard(main) -> None:
    """Run a step's main(), then exit 1 if any of its checks failed."""
    main()
    sys.exit(exit_status())
