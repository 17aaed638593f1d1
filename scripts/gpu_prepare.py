"""GPU check step: a random-weight model of a shape, drawn on the device, and its bf16 Octavo artifact.

``python scripts/gpu_prepare.py SHAPE`` writes the Hugging Face directory (octavo.bench.random_model) to
WORK/models/SHAPE and compiles it to WORK/artifacts/SHAPE; the later steps load both. On a GPU it then
starts the engine of the shape's figures once: its warm-up compiles every Triton kernel variant into the
Triton cache under the Octavo cache dir, so that the later steps' engines start warm (this step runs in
the background, beside the kernel tests). Dry run: the shape's small variant drawn on the CPU.
"""

from __future__ import annotations

import shutil
import sys
import time

import torch
from gpu_records import (
    CUDA,
    DEVICE,
    DRY_RUN,
    DRY_SHAPES,
    artifact_dir,
    check,
    checking,
    engine_config,
    figure,
    main_guard,
    model_dir,
)

from octavo.bench.random_model import parameter_count, random_config, write_random_model
from octavo.compiler import compile_model
from octavo.config import CompileConfig


def prepare(shape: str) -> None:
    overrides = DRY_SHAPES[shape] if DRY_RUN else {}
    with checking(f"prepare {shape}"):
        start = time.perf_counter()
        shutil.rmtree(model_dir(shape), ignore_errors=True)
        write_random_model(shape, model_dir(shape), dtype=torch.bfloat16, device=DEVICE, seed=0, **overrides)
        built = time.perf_counter() - start
        if CUDA:
            torch.cuda.empty_cache()  # the drawn model's memory, for the engine started below
        compile_model(model_dir(shape), artifact_dir(shape), CompileConfig(dtype="bfloat16"), overwrite=True)
        compiled = time.perf_counter() - start - built
        params = parameter_count(random_config(shape, **overrides))
        figure(f"{shape} parameters", params / 1e9, "billion", detail=f"{'dry-run variant' if DRY_RUN else 'full'}")
        check(f"prepare {shape}", True, f"random bf16 weights written in {built:.0f}s, compiled in {compiled:.0f}s",
              built + compiled)
    if CUDA:
        with checking(f"warm-up of the {shape} engine, cold"):
            from octavo.runtime.engine import LLMEngine
            from octavo.runtime.loader import load_artifact

            llm = LLMEngine(load_artifact(artifact_dir(shape), verify=False), engine_config(shape))
            figure(f"{shape}: engine warm-up with a cold Triton cache", llm.warmup_seconds, "s",
                   detail=f"{llm.executor_kind}; every ladder size captured, every kernel variant compiled")


if __name__ == "__main__":
    main_guard(lambda: prepare(sys.argv[1]))
