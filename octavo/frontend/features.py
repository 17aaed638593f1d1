"""Architecture features: what a model's config asks of the compiler, named for users, checked before tracing.

`architecture_features(config)` lists the features a supported model uses
(soft-caps, sliding windows, rope scalings, norm forms, mixtures of experts...)
with the ops each becomes in the compiled graph; the compiler records them in
the manifest and `octavo inspect` prints them. `check_supported(config)` refuses,
with one line naming it, a feature Octavo does not compile correctly, before any
weight is loaded: never at load or in the middle of a generation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from octavo.errors import UnsupportedArchitectureError
from octavo.frontend.architectures import Architecture, architecture_for

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""Rope scalings whose cos/sin depend on the position alone (or, longrope, on a threshold of it), so fuse_rope
tabulates them exactly. "dynamic" (NTK) rescales with the running sequence length in Python control flow."""
SUPPORTED_ACTIVATIONS = {"silu": "octavo.silu_and_mul", "gelu_pytorch_tanh": "octavo.gelu_and_mul(tanh)",
                         "gelu": "octavo.gelu_and_mul"}
"""The gated MLP activations the fusion passes recognize, with the op each becomes."""


@dataclass(frozen=True)
class ArchitectureFeature:
    """One feature of a model: its name, the model's values for it, and the ops it becomes."""

    name: str
    detail: str
    ops: str

    def as_dict(self) -> dict:
        return asdict(self)


def check_supported(config) -> Architecture:
    """The config's Architecture, or UnsupportedArchitectureError naming the first unsupported feature."""
    architecture = architecture_for(config)
    model_type = config.model_type
    for layer_type, rope in _rope_parameters(config):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            where = f" ({layer_type} layers)" if layer_type else ""
            raise UnsupportedArchitectureError(
                f"{model_type}: rope_type {rope_type!r}{where} is not supported (Octavo compiles "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    activation = _activation(config)
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedArchitectureError(
            f"{model_type}: MLP activation {activation!r} is not supported (Octavo compiles "
            f"{', '.join(SUPPORTED_ACTIVATIONS)})")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(f"{model_type}: use_bidirectional_attention=True is not supported "
                                           "(Octavo compiles causal decoders)")
    return architecture


def architecture_features(config) -> list[ArchitectureFeature]:
    """The features of `config`'s model that differ from a plain Llama, each with the ops it becomes."""
    architecture = architecture_for(config)
    features = [*_attention_features(config, architecture), *_rope_features(config),
                *_norm_features(architecture), *_mlp_features(config, architecture),
                *_embedding_features(config, architecture)]
    return [feature for feature in features if feature is not None]


def _attention_features(config, architecture: Architecture) -> list[ArchitectureFeature | None]:
    windows = architecture.sliding_windows(config)
    windowed = [index for index, window in enumerate(windows) if window > 0]
    cap = getattr(config, "attn_logit_softcapping", None)
    final_cap = getattr(config, "final_logit_softcapping", None)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    layers = "every layer" if len(windowed) == len(windows) else f"layers {_ranges(windowed)}"
    return [
        ArchitectureFeature("sliding-window attention", f"window {max(windows)} on {layers}",
                            "octavo.paged_attention(sliding_window)") if windowed else None,
        ArchitectureFeature("attention logit soft-cap", f"{cap}: scores become {cap} * tanh(s / {cap})",
                            "octavo.paged_attention(soft_cap)") if cap else None,
        ArchitectureFeature("final logit soft-cap", f"{final_cap}: logits become {final_cap} * tanh(l / {final_cap})",
                            "aten.div, aten.tanh, aten.mul on the pruned logits") if final_cap else None,
        ArchitectureFeature("attention scale", f"query_pre_attn_scalar {scalar}: scale {scalar ** -0.5:.6g}",
                            "octavo.paged_attention(scale)") if scalar else None,
        ArchitectureFeature("qkv bias", "q, k and v projections carry biases",
                            "aten.linear with bias (merged by fuse_qkv)") if architecture.qkv_bias else None,
        ArchitectureFeature("fused qkv and gate/up projections", "the checkpoint stores q|k|v and gate|up merged",
                            "aten.linear + slices; octavo.silu_and_mul on the chunked gate_up")
        if architecture.fused_projections else None,
    ]


def _rope_features(config) -> list[ArchitectureFeature | None]:
    features: list[ArchitectureFeature | None] = []
    parameters = _rope_parameters(config)
    per_layer_type = len(parameters) > 1 or any(layer_type for layer_type, _ in parameters)
    for layer_type, rope in parameters:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        where = f"{layer_type} layers: " if per_layer_type else ""
        if rope_type != "default":
            details = ", ".join(f"{key} {value}" for key, value in rope.items()
                                if key in ("factor", "original_max_position_embeddings", "low_freq_factor",
                                           "high_freq_factor", "beta_fast", "beta_slow"))
            features.append(ArchitectureFeature(f"rope scaling {rope_type}", f"{where}{details}",
                                                "rotary_cos_sin_cache tabulated at compile time"))
    if per_layer_type:
        bases = ", ".join(f"{layer_type} {rope.get('rope_theta')}" for layer_type, rope in parameters)
        features.append(ArchitectureFeature("per-layer-type rope", f"rope_theta {bases}",
                                            "one rotary_cos_sin_cache per layer type"))
    factor = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    if factor < 1.0:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        features.append(ArchitectureFeature("partial rotary", f"the first {int(head_dim * factor)} of {head_dim} "
                                            "dims of each head", "octavo.rotary_embedding over a narrower cache"))
    return features


def _norm_features(architecture: Architecture) -> list[ArchitectureFeature | None]:
    norms = {
        "rms_norm_offset": ArchitectureFeature("(1 + w) RMSNorm", "x̂ * (1 + w), multiplied in float32",
                                               "octavo.rms_norm(multiply_in_float32) over a float32 w + 1"),
        "rms_norm_f32_weight": ArchitectureFeature("RMSNorm weight in float32", "(w * x̂).to(dtype)",
                                                   "octavo.rms_norm(multiply_in_float32)"),
    }
    placements = {
        "pre+post": ArchitectureFeature("pre- and post-norms", "a norm before and after attention and MLP",
                                        "octavo.rms_norm / fused_add_rms_norm"),
        "post": ArchitectureFeature("post-norms", "norms after attention and MLP, before the residual add",
                                    "octavo.rms_norm / fused_add_rms_norm"),
    }
    qk_norms = {
        "head": ArchitectureFeature("QK-norm", "per head, on q and k before RoPE", "octavo.rms_norm"),
        "full": ArchitectureFeature("QK-norm", "over all heads' q and k projections", "octavo.rms_norm"),
    }
    return [norms.get(architecture.norm), placements.get(architecture.norm_placement),
            qk_norms.get(architecture.qk_norm)]


def _mlp_features(config, architecture: Architecture) -> list[ArchitectureFeature | None]:
    activation = _activation(config)
    gated = None
    if activation != "silu":
        gated = ArchitectureFeature("GELU gated MLP", activation, SUPPORTED_ACTIVATIONS.get(activation, "?"))
    if architecture.mlp != "moe":
        return [gated]
    return [gated, *_expert_features(config)]


def _expert_features(config) -> list[ArchitectureFeature | None]:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = config.num_experts_per_tok
    # Mixtral's router always renormalizes its top-k weights; the others follow norm_topk_prob.
    normalized = getattr(config, "norm_topk_prob", True)
    weights = "renormalized" if normalized else "as the softmax gives them"
    dense = sorted(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if step > 1:
        dense = sorted(set(dense) | {layer for layer in range(config.num_hidden_layers) if (layer + 1) % step})
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return [
        ArchitectureFeature("mixture of experts", f"{experts} experts, top {top_k}, weights {weights}",
                            "octavo.moe (router, chosen experts only)"),
        ArchitectureFeature("shared expert", f"intermediate size {shared}, behind a sigmoid gate",
                            "a gated MLP (octavo.silu_and_mul) beside octavo.moe") if shared else None,
        ArchitectureFeature("dense layers among experts", f"layers {_ranges(dense)} have a dense MLP",
                            "octavo.silu_and_mul") if dense else None,
    ]


def _embedding_features(config, architecture: Architecture) -> list[ArchitectureFeature | None]:
    scaled = None
    if architecture.scaled_embeddings:
        scaled = ArchitectureFeature("scaled embeddings", f"embeddings times sqrt({config.hidden_size})",
                                     "aten.mul after the embedding")
    tied = None
    if getattr(config, "tie_word_embeddings", False):
        tied = ArchitectureFeature("tied embeddings", "lm_head = embed_tokens", "one weight")
    return [scaled, tied]


def _activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _rope_parameters(config) -> list[tuple[str, dict]]:
    """(layer type or "", parameters) of each rope the model computes."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if parameters and all(isinstance(value, dict) for value in parameters.values()):
        return sorted(parameters.items())
    return [("", parameters)]


def _ranges(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) if len(indices) <= 8 else f"{indices[0]}..{indices[-1]} ({len(indices)})"

