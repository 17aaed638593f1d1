"""The pass registry and the named pipelines (the pipeline is data)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import GraphModule

from octavo.errors import PassError

PassFunction = Callable[[GraphModule, "object"], GraphModule]


@dataclass(frozen=True)
class PassInfo:
    """A registered pass. `required` passes cannot be disabled (the runtime depends on them)."""

    name: str
    description: str
    function: PassFunction
    required: bool = False


PASSES: dict[str, PassInfo] = {}

PIPELINES: dict[str, list[str]] = {
    "default": ["canonicalize", "match_attention", "prune_logits", "match_moe", "fuse_rms_norm", "fuse_add_rms_norm",
                "fuse_qkv", "fuse_gate_up", "insert_lora", "fuse_activation", "fuse_rope", "fuse_pointwise",
                "quantize_weights", "quantize_kv_cache", "narrow_weights"],
}

OPTIONAL_PASSES: dict[str, Callable[[object], bool]] = {
    "insert_lora": lambda config: bool(config.lora_targets),  # LoRA adapters asked for at compile time
    "quantize_weights": lambda config: config.quant != "none",
    "quantize_kv_cache": lambda config: config.kv_cache_dtype != "auto",
    # float32 compute over 16-bit weights (--weight-dtype)
    "narrow_weights": lambda config: config.dtype == "float32" and config.weight_dtype not in (None, "float32"),
}
"""Passes that run only when the compile config asks for them (a named pipeline lists them)."""


def register_pass(name: str, description: str, required: bool = False) -> Callable[[PassFunction], PassFunction]:
    """Decorator registering `(gm, ctx) -> gm` under `name` with a one-line description."""

    def decorate(function: PassFunction) -> PassFunction:
        if name in PASSES:
            raise ValueError(f"pass {name} registered twice")
        PASSES[name] = PassInfo(name, description, function, required)
        return function

    return decorate


def resolve_pipeline(pipeline: str | list[str], disabled: tuple[str, ...] = (), config=None) -> list[PassInfo]:
    """The passes of a named (or explicit) pipeline minus the disabled ones, validated.

    A named pipeline leaves out the OPTIONAL_PASSES that `config` does not ask for.
    """
    _ensure_passes_imported()
    if isinstance(pipeline, str):
        names = [name for name in PIPELINES[pipeline]
                 if name not in OPTIONAL_PASSES or (config is not None and OPTIONAL_PASSES[name](config))]
    else:
        names = list(pipeline)
    for name in [*names, *disabled]:
        if name not in PASSES:
            raise PassError(f"unknown pass {name!r}; known passes: {', '.join(sorted(PASSES))}")
    for name in disabled:
        if PASSES[name].required:
            raise PassError(f"pass {name} cannot be disabled: {PASSES[name].description}")
    return [PASSES[name] for name in names if name not in disabled]


def _ensure_passes_imported() -> None:
    import octavo.passes.all_passes  # noqa: F401  (each module registers its pass)
