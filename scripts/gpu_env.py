"""GPU check step: the versions the figures are quoted with, and the two ceilings they are read against.

Records {"kind": "versions", ...} (python, torch, triton, transformers, CUDA, driver, GPU name) and the
figures "copy bandwidth" (device-to-device copy, bytes read + written) and "bf16 matmul rate" (8192^3 on
random data; 512^3 in the dry run).
"""

from __future__ import annotations

import platform
import subprocess

import torch
from gpu_records import CUDA, ceilings, check, figure, main_guard, record


def driver_version() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
        return result.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def main() -> None:
    import transformers
    import triton

    gpu = torch.cuda.get_device_name() if CUDA else "none (dry run on CPU)"
    capability = ".".join(map(str, torch.cuda.get_device_capability())) if CUDA else ""
    record(kind="versions", python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
           transformers=transformers.__version__, cuda=torch.version.cuda, driver=driver_version(), gpu=gpu,
           compute_capability=capability, cpu=platform.processor() or platform.machine())
    bandwidth, flops = ceilings()
    figure("copy bandwidth", bandwidth / 1e12, "TB/s", detail="device-to-device copy, bytes read + written")
    figure("bf16 matmul rate", flops / 1e12, "TFLOP/s", detail="square product on random data")
    check("device ceilings measured", bandwidth > 0 and flops > 0,
          f"{bandwidth / 1e9:.0f} GB/s copy, {flops / 1e12:.1f} TFLOP/s bf16")


if __name__ == "__main__":
    main_guard(main)
