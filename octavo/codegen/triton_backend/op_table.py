"""Which Triton launcher and which template files implement each octavo op (no Triton import).

A template op's kernel sources are the files listed here; fused_pointwise
has no template: its kernel is generated from each node's program.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TritonOp:
    module: str                  # octavo.codegen.triton_backend.<module> holds the launcher
    launcher: str                # the launcher's name in that module
    template_files: tuple[str, ...]  # the kernel files (in this package) the launcher runs


TRITON_OPS: dict[str, TritonOp] = {
    "paged_attention": TritonOp("paged_attention", "paged_attention",
                                ("paged_attention.py", "kv_cache_write.py", "attention_decode.py",
                                 "attention_prefill.py")),
    "rms_norm": TritonOp("norm", "rms_norm", ("norm.py",)),
    "fused_add_rms_norm": TritonOp("norm", "fused_add_rms_norm", ("norm.py",)),
    "rotary_embedding": TritonOp("rotary", "rotary_embedding", ("rotary.py",)),
    "silu_and_mul": TritonOp("activation", "silu_and_mul", ("activation.py",)),
    "gelu_and_mul": TritonOp("activation", "gelu_and_mul", ("activation.py",)),
    "fused_pointwise": TritonOp("fused_pointwise", "fused_pointwise", ()),
    "linear_w8": TritonOp("quantized_linear", "linear_w8", ("quantized_linear.py",)),
    "linear_w4": TritonOp("quantized_linear", "linear_w4", ("quantized_linear.py",)),
    "linear_fp8": TritonOp("quantized_linear", "linear_fp8", ("quantized_linear.py",)),
    "embedding_w8": TritonOp("quantized_linear", "embedding_w8", ()),
    "embedding_w4": TritonOp("quantized_linear", "embedding_w4", ()),
    "linear_w16": TritonOp("quantized_linear", "linear_w16", ("quantized_linear.py",)),
    "lora": TritonOp("lora", "lora", ("lora.py",)),
    "moe": TritonOp("moe", "moe", ("moe.py", "activation.py")),
}
