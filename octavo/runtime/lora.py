"""The engine's LoRA adapters: slots of factors the graph's octavo.lora ops read, and each token's slot.

An artifact compiled with LoRA (insert_lora) reads, per targeted linear, factor inputs A [max_loras, P*R,
in] and B [max_loras, out, P*R]. `LoraManager` allocates them once and writes an adapter into a free
slot when it is loaded (PEFT files; its scale folded into B; zeros wherever it targets nothing), and
zeroes the slot when it is unloaded. Requests name their adapter; every step the manager turns the
scheduled sequences into `lora_token_slots`, each token its sequence's slot (-1: the base model).

An adapter is refused with one line when its rank is above the artifact's maximum, when it targets a
module the artifact has no LoRA op for, when every slot is taken, or when its name is already in use.
"""

from __future__ import annotations

import logging

import torch

from octavo.errors import RequestError
from octavo.ir.lora_format import LoraAdapterError, read_adapter

logger = logging.getLogger(__name__)


class LoraManager:
    """See the module docstring. `layout` is the manifest's lora section."""

    def __init__(self, layout: dict, max_loras: int, dtype: torch.dtype, device: torch.device):
        self.max_rank = int(layout["max_rank"])
        self.targets = tuple(layout["targets"])
        self.token_slots_input = layout["token_slots"]
        self.max_loras = max_loras
        self.tensors: dict[str, torch.Tensor] = {}
        self._parts: dict[str, tuple[dict, dict]] = {}  # module id -> (its linear's entry, its part)
        for entry in layout["linears"]:
            self.tensors[entry["a"]] = torch.zeros(max_loras, entry["width"], entry["in"], dtype=dtype, device=device)
            self.tensors[entry["b"]] = torch.zeros(max_loras, entry["out"], entry["width"], dtype=dtype,
                                                   device=device)
            for part in entry["parts"]:
                self._parts[part["module"]] = (entry, part)
        self.slots: dict[str, int] = {}
        self.paths: dict[str, str] = {}

    def load(self, name: str, path: str) -> int:
        """Read the adapter at `path` into a free slot under `name`; its slot. LoraAdapterError if it cannot be."""
        if name in self.slots:
            raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = read_adapter(name, path)
        if adapter.rank > self.max_rank:
            raise LoraAdapterError(f"LoRA adapter {name!r} has rank {adapter.rank}, above this artifact's maximum "
                                   f"LoRA rank {self.max_rank}")
        missing = sorted(module for module in adapter.factors if module.replace(".", "_") not in self._parts)
        if missing:
            raise LoraAdapterError(f"LoRA adapter {name!r} targets {missing[0]}, which has no LoRA op in this "
                                   f"artifact (compiled for {', '.join(self.targets)})")
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if not free:
            raise LoraAdapterError(f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots are in use "
                                   "(max_loras); unload one first")
        slot = free[0]
        self._clear(slot)
        for module, (factor_a, factor_b) in adapter.factors.items():
            entry, part = self._parts[module.replace(".", "_")]
            offset, (first, last) = part["rank_offset"], part["rows"]
            self.tensors[entry["a"]][slot, offset:offset + adapter.rank] = factor_a
            self.tensors[entry["b"]][slot, first:last, offset:offset + adapter.rank] = factor_b * adapter.scale
        self.slots[name], self.paths[name] = slot, str(path)
        logger.info("LoRA adapter %s (rank %d, %s) loaded into slot %d", name, adapter.rank,
                    ", ".join(adapter.target_modules), slot)
        return slot

    def unload(self, name: str) -> None:
        if name not in self.slots:
            raise LoraAdapterError(f"no LoRA adapter named {name!r} is loaded")
        self._clear(self.slots.pop(name))
        del self.paths[name]

    def slot_of(self, name: str) -> int:
        """The slot of a loaded adapter; RequestError naming the loaded ones otherwise."""
        if name not in self.slots:
            loaded = ", ".join(sorted(self.slots)) or "none"
            raise RequestError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return self.slots[name]

    def token_slots(self, scheduled, device: torch.device, padded_to: int | None = None) -> torch.Tensor:
        """int64 [T]: the slot of every token of the step (its sequence's adapter, -1 for none); a decode step
        padded to a ladder size (`padded_to` tokens) gets -1 for its padding."""
        slots: list[int] = []
        for item in scheduled:
            name = item.seq.lora_name
            slots += [self.slots[name] if name is not None else -1] * item.num_new_tokens
        if padded_to is not None:
            slots += [-1] * (padded_to - len(slots))
        return torch.tensor(slots, dtype=torch.int64, device=device)

    def _clear(self, slot: int) -> None:
        for tensor in self.tensors.values():
            tensor[slot].zero_()
