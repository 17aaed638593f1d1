"""Triton launcher of octavo.fused_pointwise: generate, compile and launch one kernel per program.

The installed code generator (pointwise_codegen) turns the node's program
into source text; the text is written to the kernel cache directory
(``$OCTAVO_CACHE_DIR/triton_kernels``, else ``~/.cache/octavo/triton_kernels``,
the compile cache's root) and imported from there, since @triton.jit reads
a kernel's source from its file. An artifact's own kernels/ directory is
never imported: what runs is always what this Octavo generates.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx import Node

from octavo.codegen.triton_backend.availability import rows_per_program
from octavo.codegen.triton_backend.pointwise_codegen import (
    generate_source,
    has_reduction,
    kernel_name,
    num_program_inputs,
    result_is_per_row,
    rounded_steps,
)
from octavo.codegen.triton_backend.pointwise_ops import REDUCTIONS
from octavo.codegen.triton_backend.sources import fused_program
from octavo.errors import OctavoError
from octavo.ir.ops.fused_pointwise import bind, decode_program

KERNEL_DIR_NAME = "triton_kernels"
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
"""Compile options of every generated kernel: no multiply-add contraction. A program's steps round one by one,
as the unfused ops do; with contraction allowed, Triton computes a bf16 `mul` then `add` in bf16 arithmetic and
the compiler fuses them into one fma.rn.bf16x2 (seen in the sm_90 PTX), which rounds once instead of twice.
Pointwise kernels are memory-bound: the separate multiply and add cost nothing measurable."""
_loaded: dict[str, object] = {}
_load_lock = threading.Lock()


def fused_pointwise(inputs: list[Tensor], program: str) -> Tensor:
    """octavo.fused_pointwise on the Triton backend: one generated kernel launch."""
    kernel = load_kernel(program)
    plan = launch_plan(program, tuple(TensorMeta(tensor.dtype, tuple(tensor.shape)) for tensor in inputs))
    output = torch.empty(plan.output_shape, dtype=plan.output_dtype, device=inputs[0].device)
    if output.numel() == 0:
        return output
    arguments: list = []
    for tensor in inputs:
        # [rows, N] view of the broadcast input: zero strides where it is broadcast.
        rows = torch.broadcast_to(tensor, plan.full_shape).reshape(plan.num_rows, plan.num_columns)
        arguments += [rows, rows.stride(0), rows.stride(1)]
    kernel[(triton.cdiv(plan.num_rows, plan.block_r), plan.column_blocks)](
        *arguments, output, plan.output_row_stride, plan.num_rows, plan.num_columns,
        **{f"STEP{index}_DTYPE": dtype for index, dtype in plan.step_dtypes}, BLOCK_R=plan.block_r,
        BLOCK_N=plan.block_n, **LAUNCH_OPTIONS,
    )
    return output


def prepare(node: Node) -> None:
    """Generate and import the kernel of a fused_pointwise node ahead of its first call (at load)."""
    load_kernel(fused_program(node))


fused_pointwise.prepare = prepare


def load_kernel(program: str):
    """The @triton.jit kernel of `program`, generated and imported once per process."""
    name = kernel_name(program)
    kernel = _loaded.get(name)
    if kernel is None:
        with _load_lock:
            kernel = _loaded.get(name) or _import_kernel(name, generate_source(program))
            _loaded[name] = kernel
    return kernel


def kernel_cache_dir() -> Path:
    """Where generated kernel sources are written for import (same root as octavo.compile_cache)."""
    if os.environ.get("OCTAVO_CACHE_DIR"):
        root = Path(os.environ["OCTAVO_CACHE_DIR"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "octavo"
    return root / KERNEL_DIR_NAME


def _import_kernel(name: str, source: str):
    directory = kernel_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    # (Re)write unless the file already holds exactly this text; the rename keeps readers from a partial file.
    if not path.is_file() or path.read_text() != source:
        staging = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        staging.write_text(source)
        os.replace(staging, path)
    module_name = f"octavo_generated_{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs besides the tensors: shapes, dtypes, grid and block size."""

    full_shape: tuple[int, ...]
    num_rows: int
    num_columns: int
    column_blocks: int
    block_r: int
    block_n: int
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    output_row_stride: int
    step_dtypes: tuple[tuple[int, object], ...]


class TensorMeta(NamedTuple):
    """dtype and shape of one input (the launch plan's cache key)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


@lru_cache(maxsize=4096)
def launch_plan(program: str, inputs: tuple[TensorMeta, ...]) -> LaunchPlan:
    """Shapes and step dtypes for these input dtypes and shapes (torch's broadcasting and promotion)."""
    steps = decode_program(program)
    if len(inputs) < num_program_inputs(steps):
        raise OctavoError(f"fused_pointwise program reads {num_program_inputs(steps)} inputs, got {len(inputs)}")
    results = step_metas(steps, inputs)
    full_shape = tuple(torch.broadcast_shapes(*[meta.shape for meta in inputs])) or (1,)
    num_columns = full_shape[-1]
    num_rows = math.prod(full_shape[:-1])
    for index, step in enumerate(steps):
        if step.name in REDUCTIONS:
            source = step.args[0]
            source_shape = results[source.index].shape if source.kind == "step" else inputs[source.index].shape
            if not source_shape or source_shape[-1] != num_columns:
                raise OctavoError(f"fused_pointwise step {index} ({step.name}) must reduce a full row of "
                                  f"{num_columns} values, got shape {list(source_shape)}")
    output = results[-1]
    per_row_output = result_is_per_row(steps)
    if output.numel() != num_rows * (1 if per_row_output else num_columns):
        raise OctavoError(f"fused_pointwise output shape {list(output.shape)} does not fit the iteration "
                          f"space {list(full_shape)}")
    if has_reduction(steps):
        block_n, column_blocks = max(16, triton.next_power_of_2(num_columns)), 1
    else:
        block_n = min(max(16, triton.next_power_of_2(num_columns)), 1024)
        column_blocks = triton.cdiv(num_columns, block_n)
    step_dtypes = tuple((index, _triton_dtype(results[index].dtype)) for index in rounded_steps(steps))
    return LaunchPlan(full_shape, num_rows, num_columns, column_blocks, rows_per_program(block_n, num_rows), block_n,
                      tuple(output.shape), output.dtype, 1 if per_row_output else num_columns, step_dtypes)


def step_metas(steps, inputs: tuple[TensorMeta, ...]) -> list[Tensor]:
    """Every step's result as a meta tensor (dtype and shape only), by running its ATen op on meta tensors."""
    tensors = [torch.empty(meta.shape, dtype=meta.dtype, device="meta") for meta in inputs]
    results: list[Tensor] = []
    for step in steps:
        args = bind(step.args, tensors, results)
        kwargs = {key: bind(value, tensors, results) for key, value in step.kwargs.items()}
        results.append(step.op(*args, **kwargs))
    return results


def _triton_dtype(dtype: torch.dtype):
    if dtype == torch.bool:
        return tl.int1
    return getattr(tl, str(dtype).removeprefix("torch."))
