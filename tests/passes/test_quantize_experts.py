"""quantize_weights on a mixture of experts: stacked w4 experts, run by the C++ kernel as by the torch reference.

The torch backend computes octavo.moe's definition (each expert's dequantized weights, float32 linears);
the cpu backend's kernel reads the 4-bit bytes in place (the w4 GEMV sums in another order): the two must
give the same logits step by step within float32 reassociation (a few 1e-6 of logits of size ~1). The
other quantized linears are pinned to the one dequantizing float32 kernel on both backends
(OCTAVO_CPU_QUANT_KERNEL=dequantized), so that only the experts' kernels differ.
"""

from __future__ import annotations

import pytest
import torch

from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.loader import read_manifest
from octavo.runtime.sampling_params import SamplingParams
from tests.tiny_models import COMMON

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = COMMON["num_hidden_layers"]


@pytest.fixture(scope="module")
def artifact(tiny_quantized_artifact):
    return tiny_quantized_artifact("qwen3_moe", quant="w4")


def test_experts_are_stored_stacked_in_the_w4_layout(artifact):
    manifest = read_manifest(artifact)
    stats = next(record["stats"] for record in manifest["passes"] if record["name"] == "quantize_weights")
    assert stats["quantized_moe"] == LAYERS
    histogram = manifest["op_histogram"]
    assert histogram["octavo.moe"] == LAYERS and "aten.bmm" not in histogram
    from safetensors import safe_open

    with safe_open(str(artifact / "weights.safetensors"), "pt") as weights:
        names = set(weights.keys())
        qweight = weights.get_tensor("model_layers_0_mlp_experts_gate_up_proj_qweight")
        scales = weights.get_tensor("model_layers_0_mlp_experts_gate_up_proj_scales")
    assert qweight.dtype == torch.uint8 and tuple(qweight.shape) == (4, 64, 32)  # [E, 2I, H / 2]
    assert tuple(scales.shape) == (4, 64, 2)  # groups of 32 over H = 64
    assert "model_layers_0_mlp_gate_weight" in names, "the router stays float"


def test_cpu_kernel_matches_the_torch_reference_step_by_step(artifact, monkeypatch):
    from octavo.codegen.torch_backend.weight_packing import FORCE_KERNEL_ENV

    monkeypatch.setenv(FORCE_KERNEL_ENV, "dequantized")
    prompts = [[5 + index * 7 for index in range(length)] for length in (21, 3, 9)]
    logits = {}
    for backend in ("torch", "cpu"):
        engine = LLMEngine(artifact, EngineConfig(backend=backend, num_kv_blocks=32, max_num_batched_tokens=16,
                                                  executor="eager"))
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        rows = []
        while engine.has_unfinished_requests():
            engine.step()
            rows.append(engine.last_step.logits.float().clone())
        logits[backend] = rows
    assert len(logits["cpu"]) == len(logits["torch"])
    for step, (native, reference) in enumerate(zip(logits["cpu"], logits["torch"], strict=True)):
        torch.testing.assert_close(native, reference, atol=1e-4, rtol=0, msg=lambda text, step=step: f"{step}: {text}")
