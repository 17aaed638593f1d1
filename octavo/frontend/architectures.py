"""The architecture table: what each supported model_type needs from the compiler."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class Architecture:
    """Traits of a decoder-only architecture that the passes and runtime rely on.

    norm: the normalization kind ("rms_norm"); activation: the MLP activation
    ("silu" for gated SiLU); rope: the rotary kind ("rotate_half");
    qkv_bias: q/k/v projections carry a bias; qk_norm: per-head RMSNorm on q
    and k before RoPE; sliding_window: the model may use sliding-window
    attention on some or all layers (read per layer by `sliding_windows`);
    per_layer_attention: the HF model reads the config's `layer_types` to pick
    each layer's attention (False: `sliding_window` applies to every layer).
    """

    model_type: str
    norm: str = "rms_norm"
    activation: str = "silu"
    rope: str = "rotate_half"
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: bool = False
    per_layer_attention: bool = False

    def sliding_windows(self, config) -> list[int]:
        """The attention window of each layer of a model of this architecture, -1 for full attention.

        Qwen2/Qwen3 record per-layer attention kinds in `layer_types`
        ("sliding_attention" / "full_attention"). Mistral's model applies
        `sliding_window`, when set, to every layer and ignores `layer_types`
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


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama"),
    "mistral": Architecture("mistral", sliding_window=True),
    "qwen2": Architecture("qwen2", qkv_bias=True, sliding_window=True, per_layer_attention=True),
    "qwen3": Architecture("qwen3", qk_norm=True, sliding_window=True, per_layer_attention=True),
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
