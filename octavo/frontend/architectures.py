"""The architecture table: what each supported model_type needs from the compiler."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Architecture:
    """Traits of a decoder-only architecture that the passes and runtime rely on.

    norm: how the RMSNorm weight applies: "rms_norm" (Llama: ``w * x̂.to(dtype)``),
    "rms_norm_f32_weight" (OLMo 2: ``(w * x̂).to(dtype)``, the multiply in float32) or
    "rms_norm_offset" (Gemma: ``(x̂ * (1 + w)).to(dtype)``, float32).
    activation: the gated MLP's activation ("silu"; "gelu_tanh" for Gemma's gelu_pytorch_tanh).
    rope: the rotary kind ("rotate_half"). qkv_bias: q/k/v projections carry a bias.
    qk_norm: RMSNorm on q and k before RoPE, "head" (per head, Qwen3, Gemma 3) or "full" (over all
    heads' projection, OLMo 2), "" for none. sliding_window: the model may use sliding-window
    attention on some or all layers (read per layer by `sliding_windows`); per_layer_attention:
    the HF model reads the config's `layer_types` to pick each layer's attention (False:
    `sliding_window` applies to every layer). norm_placement: "pre" (a norm before attention and
    MLP), "post" (OLMo 2: after them, before the residual add) or "pre+post" (Gemma: both).
    scaled_embeddings: the embedding output is multiplied by sqrt(hidden_size).
    fused_projections: the checkpoint stores q/k/v and gate/up as one linear each (Phi-3).
    mlp: "dense" (every layer a gated MLP) or "moe" (some or all layers a mixture of experts).
    families: the model families users know this model_type by (for the README's list).
    """

    model_type: str
    norm: str = "rms_norm"
    activation: str = "silu"
    rope: str = "rotate_half"
    qkv_bias: bool = False
    qk_norm: str = ""
    sliding_window: bool = False
    per_layer_attention: bool = False
    norm_placement: str = "pre"
    scaled_embeddings: bool = False
    fused_projections: bool = False
    mlp: str = "dense"
    families: str = ""

    def sliding_windows(self, config) -> list[int]:
        """The attention window of each layer of a model of this architecture, -1 for full attention.

        Qwen2/Qwen3/Gemma record per-layer attention kinds in `layer_types`
        ("sliding_attention" / "full_attention"). Mistral's and Phi-3's models apply
        `sliding_window`, when set, to every layer and ignore `layer_types`
        even when a checkpoint's config carries one. Passes call this on
        PassContext.architecture, so they need nothing from the frontend.
        """
        num_layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if not self.sliding_window or not window:
            return [-1] * num_layers
        layer_types = getattr(config, "layer_types", None) if self.per_layer_attention else None
        if layer_types is None:
            return [int(window)] * num_layers
        return [int(window) if kind == "sliding_attention" else -1 for kind in layer_types]

    def attention_implementation(self, config) -> str:
        """The HF attention the frontend traces: "sdpa", or "eager" where SDPA would drop a score soft-cap.

        Transformers' SDPA path ignores `attn_logit_softcapping` (and refuses Gemma 2 for it); its
        eager path computes the cap, and match_attention recognizes either form.
        """
        return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"

    def load_options(self, config) -> dict:
        """Keyword arguments of from_pretrained for tracing: the attention, and for mixtures of experts
        transformers' batched_mm experts (its eager experts loop over the experts a batch hit, a
        data-dependent loop torch.export cannot trace; batched_mm computes the same routed experts with
        gathers and batched matmuls, which match_moe recognizes)."""
        options = {"attn_implementation": self.attention_implementation(config)}
        if self.mlp == "moe":
            options["experts_implementation"] = "batched_mm"
        return options


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", families="Llama 2, Llama 3.x, SmolLM"),
    "mistral": Architecture("mistral", sliding_window=True, families="Mistral"),
    "qwen2": Architecture("qwen2", qkv_bias=True, sliding_window=True, per_layer_attention=True,
                          families="Qwen2, Qwen2.5"),
    "qwen3": Architecture("qwen3", qk_norm="head", sliding_window=True, per_layer_attention=True, families="Qwen3"),
    "gemma2": Architecture("gemma2", norm="rms_norm_offset", activation="gelu_tanh", sliding_window=True,
                           per_layer_attention=True, norm_placement="pre+post", scaled_embeddings=True,
                           families="Gemma 2"),
    "gemma3_text": Architecture("gemma3_text", norm="rms_norm_offset", activation="gelu_tanh", qk_norm="head",
                                sliding_window=True, per_layer_attention=True, norm_placement="pre+post",
                                scaled_embeddings=True, families="Gemma 3 (text)"),
    "phi3": Architecture("phi3", sliding_window=True, fused_projections=True, families="Phi-3, Phi-4-mini"),
    "olmo2": Architecture("olmo2", norm="rms_norm_f32_weight", qk_norm="full", norm_placement="post",
                          families="OLMo 2"),
    "qwen3_moe": Architecture("qwen3_moe", qk_norm="head", sliding_window=True, mlp="moe",
                              families="Qwen3-MoE (30B-A3B, 235B-A22B)"),
    "qwen2_moe": Architecture("qwen2_moe", qkv_bias=True, sliding_window=True, per_layer_attention=True, mlp="moe",
                              families="Qwen1.5-MoE, Qwen2-MoE"),
    "mixtral": Architecture("mixtral", sliding_window=True, mlp="moe", families="Mixtral"),
    "olmoe": Architecture("olmoe", qk_norm="full", mlp="moe", families="OLMoE"),
}


def architecture_for(config) -> Architecture:
    """Look up a Hugging Face config's model_type, or fail naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r}: Octavo supports {supported}")
    return ARCHITECTURES[model_type]


def sliding_windows(config) -> list[int]:
    """The attention window of each layer of `config`'s model, -1 for full attention (Architecture.sliding_windows)."""
    return architecture_for(config).sliding_windows(config)
