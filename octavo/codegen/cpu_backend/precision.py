"""Which dtypes compute fast on this CPU: the choice behind --dtype auto, and the slow-dtype warning.

Measured on an AVX-512 CPU with AVX512_BF16 and no AMX (AMD Zen 5, 2 threads, torch 2.13, oneDNN;
SmolLM2's 576x1536 linear): bfloat16 linears ran ~7x slower than float32 at m=1 and ~2x slower at
m=64, faster only from m=512 on. Decode runs at m = batch size, so there bfloat16 compute loses;
AVX2-only CPUs emulate it (~7x slower). Only AMX makes bf16 (AMX-BF16) or fp16 (AMX-FP16) matmuls
fast at every m. Where they are not fast, auto picks float32 weights and compute: the compiled
executor runs float32 linears on oneDNN-prepacked weights, which measured faster than float32
compute over bfloat16-stored weights (the opaque linear_w16 kernel) at every batch above one
(SmolLM2, same machine: 64 requests 264 vs 149 output tok/s, a shared prefix 339 vs 175); the 16-bit
weights win only single-stream decode (~10%), where `--weight-dtype bfloat16` asks for them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from octavo.codegen.cpu_backend.isa import CpuTarget, cpu_target
from octavo.config import CompileConfig

logger = logging.getLogger(__name__)

FIX_HINT = "recompile with --dtype float32 (or --dtype auto)"


@dataclass(frozen=True)
class PrecisionChoice:
    """What --dtype auto resolves to here, and why."""

    dtype: str
    weight_dtype: str
    reason: str


def fast_compute_dtypes(target: CpuTarget | None = None) -> tuple[str, ...]:
    """The compute dtypes this CPU runs matmuls in at full speed: float32, plus bf16 / fp16 with AMX."""
    target = target or cpu_target()
    fast = ["float32"]
    if target.amx:
        fast.append("bfloat16")
    if target.amx_fp16:
        fast.append("float16")
    return tuple(fast)


def choose_precision(weight_dtype: str | None = None, target: CpuTarget | None = None) -> PrecisionChoice:
    """--dtype auto: bfloat16 where AMX computes it natively, else float32 (weights as `weight_dtype` says).

    An explicit `weight_dtype` other than bfloat16 keeps float32 compute (a bf16 artifact stores bf16).
    """
    target = target or cpu_target()
    if "bfloat16" in fast_compute_dtypes(target) and weight_dtype in (None, "bfloat16"):
        return PrecisionChoice("bfloat16", "bfloat16", f"{target.describe()}: AMX computes bfloat16 natively")
    storage = weight_dtype or "float32"
    why = ("AVX512_BF16 without AMX measured slower than float32 at decode batch sizes" if target.avx512_bf16
           else "no native bfloat16 matmul")
    weights = (f"float32 compute over {storage} weights" if storage != "float32" else
               "float32 on prepacked weights (--weight-dtype bfloat16 halves the bytes a single-stream step reads)")
    return PrecisionChoice("float32", storage, f"{target.describe()}: {why}; {weights}")


def resolve_precision(config: CompileConfig) -> CompileConfig:
    """`config` with dtype "auto" replaced by this machine's choice (logged, and kept in dtype_choice).

    A quantized config (--quant) keeps its weights as the scheme stores them: auto then only picks
    the compute dtype.
    """
    if config.dtype != "auto":
        return config
    choice = choose_precision(config.weight_dtype)
    weight_dtype = None if choice.weight_dtype == choice.dtype else choice.weight_dtype
    if config.quant != "none" and config.weight_dtype is None:
        weight_dtype = None
    logger.info("--dtype auto: %s compute, %s weights (%s)", choice.dtype, choice.weight_dtype, choice.reason)
    return dataclasses.replace(config, dtype=choice.dtype, weight_dtype=weight_dtype,
                               dtype_choice=f"auto: {choice.reason}")


def slow_dtype_warning(dtype: str, target: CpuTarget | None = None) -> str | None:
    """A warning for running a `dtype` artifact on this CPU, or None when it computes that dtype fast."""
    target = target or cpu_target()
    if dtype in fast_compute_dtypes(target):
        return None
    return (f"this artifact computes in {dtype}, which this CPU ({target.describe()}) has no fast matmul for: "
            f"steps run several times slower than in float32; {FIX_HINT}")
