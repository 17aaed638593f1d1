"""`octavo bench --profile`'s model split on a mixture of experts: routing, permutation and expert GEMMs apart."""

from __future__ import annotations

import pytest
from torch.profiler import ProfilerActivity, profile

from octavo.bench.profile import StepProfile, format_profiles, split_model_time
from octavo.config import EngineConfig
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_moe_step_is_split_into_routing_permutation_and_experts(tiny_artifact, backend):
    engine = LLMEngine(tiny_artifact("qwen3_moe"), EngineConfig(backend=backend, num_kv_blocks=16, executor="eager"))
    engine.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler, engine.phases.record():
        engine.step()  # a decode
    parts, total = split_model_time(profiler.events())
    assert all(parts[part] > 0 for part in ("moe routing", "moe permutation", "moe experts", "attention")), parts
    assert sum(parts.values()) == pytest.approx(total)
    line = format_profiles([StepProfile("decode, 1 sequence", 1, {"model": total}, parts, total)])[-1]
    assert "moe routing" in line and "moe experts" in line
