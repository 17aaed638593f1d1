"""Imports every pass module so that each registers itself."""

from octavo.passes import (  # noqa: F401
    canonicalize,
    fuse_activation,
    fuse_add_rms_norm,
    fuse_gate_up,
    fuse_pointwise,
    fuse_qkv,
    fuse_rms_norm,
    fuse_rope,
    insert_lora,
    match_attention,
    match_moe,
    narrow_weights,
    prune_logits,
    quantize_kv_cache,
    quantize_weights,
    shard_tensor_parallel,
    split_pipeline_stages,
)
