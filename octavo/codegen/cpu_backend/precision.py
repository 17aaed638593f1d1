"""Which dtypes compute fast on this CPU: the choice behind --dtype auto, and the slow-dtype warning.

bfloat16 is fast where the CPU multiplies it natively: AMX (AMX-BF16) and AVX512_BF16 (the
VDPBF16PS dot product). Measured on an AMD Zen 5 with AVX512_BF16 and no AMX (2 threads, torch 2.13,
oneDNN on prepacked weights, SmolLM2's linear shapes): a bfloat16 linear runs 84 vs 34 GFLOP/s at
m=1 (576x3072) and 830-890 vs 165-190 GFLOP/s at m=64..256; the whole bfloat16 SmolLM2 decodes one
sequence in 11.2-12.2 ms per token against 14.3-15.2 ms in float32 (half the weight bytes) and serves
64 requests at 463 against 300 output tok/s. AVX2-only CPUs emulate bfloat16 (~7x slower than float32 measured on
an AMD AVX2 machine), so there auto picks float32. fp16 compute is fast only with AMX-FP16.

A quantized config (--quant) computes in bfloat16 on the same CPUs: its linears' own GEMMs multiply
the dequantized weights as bfloat16 (AMX tiles, else vdpbf16ps) and the whole step's activations and
KV cache are half the bytes. Measured on the Zen 5 above (SmolLM2, throughput workload, 2 threads): w8
670 and w4 640 output tok/s in bfloat16 against 342 and 350 in float32 (bfloat16 itself: 649). CPUs
without native bfloat16 keep float32.
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
    """Compute dtypes this CPU multiplies at full speed: float32, bf16 (AMX or AVX512_BF16), fp16 (AMX-FP16)."""
    target = target or cpu_target()
    fast = ["float32"]
    if target.amx or target.avx512_bf16:
        fast.append("bfloat16")
    if target.amx_fp16:
        fast.append("float16")
    return tuple(fast)


def choose_precision(weight_dtype: str | None = None, target: CpuTarget | None = None) -> PrecisionChoice:
    """--dtype auto: bfloat16 where the CPU computes it natively, else float32 (weights as `weight_dtype` says).

    An explicit `weight_dtype` other than bfloat16 keeps float32 compute (a bf16 artifact stores bf16).
    A quantized config computes as an unquantized one would (see the module docstring).
    """
    target = target or cpu_target()
    native = "AMX" if target.amx else "AVX512_BF16"
    if "bfloat16" in fast_compute_dtypes(target) and weight_dtype in (None, "bfloat16"):
        return PrecisionChoice("bfloat16", "bfloat16", f"{target.describe()}: {native} computes bfloat16 natively")
    storage = weight_dtype or "float32"
    why = "no native bfloat16 matmul" if weight_dtype in (None, "bfloat16") else f"{weight_dtype} weights asked for"
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
