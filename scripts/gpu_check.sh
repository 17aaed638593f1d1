#!/usr/bin/env bash
# The GPU check of Octavo (`make gpu-check`, or run it directly): correctness natively on a CUDA GPU, then
# speed figures, each read against a ceiling measured in the same run. Made to fit one call of a lent GPU
# machine: it ends within OCTAVO_GPU_CHECK_BUDGET seconds (default 525, under 9 minutes), builds the models
# it needs on the GPU from their configs with random weights (no model file), and needs no network.
# docs/gpu.md gives the command with the wheels a bare image lacks, and what the summary holds.
#
# Steps (scripts/gpu_check.py runs them, each under a timeout; `prepare` steps run in the background):
#   1. versions (python, torch, triton, transformers, CUDA, driver, GPU) and the device's ceilings
#   2. prepare: random-weight SmolLM2-135M and Llama-3.1-8B shapes, compiled to bf16 artifacts, Triton warmed
#   3. Triton kernel tests natively (tests/codegen/triton, OCTAVO_TEST_DEVICE=cuda)
#   4. CUDA-graph ladder: replay == eager bitwise, caches == eager caches, padding rows write nowhere
#   5. engine step by step on every tiny architecture: triton vs torch backend vs HF
#   6-8. per model shape: greedy tokens under teacher forcing vs HF, then its speed figures; kernel timings
# Where $OUT is set, the summary is $OUT/gpu_check.json (the steps' logs: $OUT/gpu_check.log).
# Without a GPU the same steps run as a dry run at tiny sizes on the CPU (Triton's interpreter).
# Exit status 0 when no step and no check failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s.%N)}"
# The interpreter: OCTAVO_GPU_PYTHON, else the project's .venv (make setup), else python3 (GPU images ship one).
PY="${OCTAVO_GPU_PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

missing="$("$PY" - <<'PY'
import importlib.util
modules = ["torch", "triton", "transformers", "tokenizers", "safetensors", "accelerate", "gguf", "onnx", "networkx",
           "numpy", "jinja2", "rich", "tqdm", "psutil", "sympy", "huggingface_hub", "fastapi", "starlette",
           "pydantic", "pydantic_core", "uvicorn", "httpx", "prometheus_client", "pytest"]
print(" ".join(name for name in modules if importlib.util.find_spec(name) is None))
PY
)" || { echo "gpu_check: $PY does not run" >&2; exit 2; }
if [ -n "$missing" ]; then
    echo "gpu_check: $PY lacks: $missing. Install them, or carry them as wheels (docs/gpu.md)." >&2
    exit 2
fi
if [ -z "${GPU_CHECK_DEVICE:-}" ]; then
    GPU_CHECK_DEVICE="$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')"
fi
export GPU_CHECK_DEVICE
exec "$PY" scripts/gpu_check.py
