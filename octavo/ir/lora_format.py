"""PEFT LoRA adapters on disk: `adapter_config.json` + `adapter_model.safetensors`, read and checked.

An adapter's weights are pairs per targeted linear: ``lora_A`` [r, in] and ``lora_B`` [out, r], under
PEFT's names (``base_model.model.<module path>.lora_A.weight``). Its update of a linear is
``scale * B @ A @ x`` with ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA). Only plain
LoRA is read: DoRA, trained biases, extra trained modules (``modules_to_save``) and per-module ranks
are refused with one line naming what the adapter has. The compiler reads adapters to decide which
linears get an `octavo.lora` op and with what rank; the runtime reads them to fill its slots.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from octavo.errors import OctavoError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class LoraAdapterError(OctavoError):
    """An adapter that cannot be read or cannot be served by this artifact (one line saying why)."""


@dataclass
class LoraAdapter:
    """One adapter: `factors` maps a module path ("model.layers.0.self_attn.q_proj") to (A [r, in], B [out, r])."""

    name: str
    path: Path
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str | Path) -> dict:
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoraAdapterError(f"{path} is not a PEFT adapter: it has no {CONFIG_FILE}")
    try:
        return json.loads(config_path.read_text())
    except ValueError as error:
        raise LoraAdapterError(f"{config_path} is not valid JSON: {error}") from None


def read_adapter(name: str, path: str | Path) -> LoraAdapter:
    """The adapter at `path` (its config checked, its factors loaded on the CPU)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_adapter_config(path)
    _check_plain_lora(path, config)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoraAdapterError(f"adapter {name!r} at {path} has no {WEIGHTS_FILE}")
    tensors = load_file(str(weights_path))
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise LoraAdapterError(f"adapter {name!r} holds {key}, which is not a LoRA factor (only lora_A and "
                                   "lora_B weights are served)")
        factors.setdefault(module, {})[kind[0]] = tensor
    pairs = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise LoraAdapterError(f"adapter {name!r}: {module} needs lora_A [{rank}, in] and lora_B [out, {rank}]")
        pairs[module] = (pair["A"], pair["B"])
    targets = config.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return LoraAdapter(name, path, rank, scale, targets, pairs)


def _check_plain_lora(path: Path, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{path} is a {config['peft_type']} adapter; only LoRA adapters are served")
    unsupported = [field for field, off in (("use_dora", False), ("bias", "none"), ("modules_to_save", None),
                                            ("rank_pattern", {}), ("alpha_pattern", {}))
                   if config.get(field) not in (off, None, {}, [])]
    if unsupported:
        raise LoraAdapterError(f"{path} uses {', '.join(unsupported)}, which Octavo does not serve (plain LoRA only)")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoraAdapterError(f"{path}: adapter_config.json needs a rank r >= 1, got {config.get('r')!r}")


def module_suffix(module: str) -> str:
    """The name PEFT's target_modules match: the module path's last part ("q_proj")."""
    return module.rpartition(".")[2]
