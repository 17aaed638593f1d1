"""Multi-tenant LoRA on the tiny llama: PEFT adapters built here with the `peft` package, compiled in with
`--lora` or loaded at run time, requests of different adapters (and none) in one batch, each equal to
Hugging Face's model with that adapter merged (fp32, greedy); adapters the artifact cannot serve refused
with one line."""

from __future__ import annotations

import json

import pytest
import torch

from octavo.compiler import compile_model
from octavo.config import CompileConfig
from octavo.errors import RequestError
from octavo.ir.lora_format import LoraAdapterError
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[31, 414, 2768, 314, 99, 5012], [1267, 12, 7, 99, 5012, 8, 77, 3050, 12, 900, 41, 16, 5, 18, 21, 33, 2]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def merged_outputs(tiny_model_dir, lora_adapters):
    """Hugging Face greedy tokens of each prompt, per adapter merged into the weights (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    outputs = {}
    for name in (None, "a", "b", "c"):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32,
                                                     attn_implementation="eager")
        if name is not None:
            model = PeftModel.from_pretrained(model, lora_adapters[name]).merge_and_unload()
        for index, prompt in enumerate(PROMPTS):
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outputs[name, index] = generated[0, len(prompt):].tolist()
    return outputs


def run(engine, requests: list[tuple[str | None, int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for number, (name, index) in enumerate(requests):
        engine.add_request(PROMPTS[index], params, request_id=str(number), lora=name)
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    return [finals[str(number)].outputs[0].token_ids for number in range(len(requests))]


def test_the_pass_adds_one_lora_op_per_targeted_linear(tiny_lora_artifact):
    manifest = json.loads((tiny_lora_artifact / "manifest.json").read_text())
    assert manifest["op_histogram"]["octavo.lora"] == 8  # per layer: qkv, o, gate_up, down
    assert manifest["lora"]["max_rank"] == 8 and set(manifest["lora"]["adapters"]) == {"a", "b"}


def test_adapters_mixed_in_one_batch_equal_hf_with_each_merged(tiny_lora_artifact, merged_outputs):
    engine = make_engine(tiny_lora_artifact, num_kv_blocks=64)
    requests = [(None, 0), ("a", 0), ("b", 0), ("a", 1), (None, 1), ("b", 1), ("a", 0)]
    assert run(engine, requests) == [merged_outputs[request] for request in requests]


def test_the_compiled_executor_serves_mixed_adapters_as_hf_merged(tiny_lora_artifact, lora_adapters, merged_outputs,
                                                                   compiled_cache):
    """The default executor (AOTInductor) calls the backend's LoRA kernel back from compiled code; a run-time
    adapter fills a slot of the same package."""
    engine = make_engine(tiny_lora_artifact, num_kv_blocks=64, executor="compiled",
                         lora_modules=(f"c={lora_adapters['c']}",))
    assert engine.executor_kind == "compiled"
    requests = [(None, 0), ("a", 0), ("c", 1), ("b", 1), ("a", 1), ("c", 0)]
    assert run(engine, requests) == [merged_outputs[request] for request in requests]


def test_an_adapter_loaded_at_run_time(tiny_lora_artifact, lora_adapters, merged_outputs):
    engine = make_engine(tiny_lora_artifact, num_kv_blocks=64, lora_modules=(f"c={lora_adapters['c']}",))
    assert run(engine, [("c", 0), ("a", 1), ("c", 1)]) == [merged_outputs["c", 0], merged_outputs["a", 1],
                                                           merged_outputs["c", 1]]
    engine.unload_lora("c")
    with pytest.raises(RequestError, match="unknown LoRA adapter 'c'"):
        engine.add_request(PROMPTS[0], SamplingParams(), lora="c")
    engine.load_lora("c2", str(lora_adapters["c"]))
    assert run(engine, [("c2", 0)]) == [merged_outputs["c", 0]]


def test_llm_generate_under_an_adapter(tiny_lora_artifact, merged_outputs):
    from octavo.llm import LLM

    llm = LLM(tiny_lora_artifact, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = llm.generate([PROMPTS[1]], params, lora="b")
    assert output.outputs[0].token_ids == merged_outputs["b", 1]
    [rejected] = llm.generate([PROMPTS[1]], params, lora="nope")
    assert "unknown LoRA adapter 'nope'" in rejected.error


def test_adapters_the_artifact_cannot_serve_are_refused_in_one_line(tiny_lora_artifact, lora_adapters, tiny_model_dir,
                                                                    tmp_path_factory):
    engine = make_engine(tiny_lora_artifact, num_kv_blocks=64, max_loras=3)
    with pytest.raises(LoraAdapterError, match="rank 16, above this artifact's maximum LoRA rank 8"):
        engine.load_lora("wide", str(lora_adapters["wide"]))
    narrow = compile_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("narrow") / "artifact",
                           CompileConfig(dtype="float32", lora_targets=("q_proj", "v_proj"), max_lora_rank=8))
    with pytest.raises(LoraAdapterError, match=r"targets model\.layers\.0\.mlp\.down_proj, which has no LoRA op"):
        make_engine(narrow, num_kv_blocks=64).load_lora("a", str(lora_adapters["a"]))
    engine.load_lora("c", str(lora_adapters["c"]))
    with pytest.raises(LoraAdapterError, match="all 3 slots are in use"):
        engine.load_lora("c2", str(lora_adapters["c"]))
    with pytest.raises(LoraAdapterError, match="already loaded"):
        engine.load_lora("a", str(lora_adapters["a"]))
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="busy", lora="c")
    with pytest.raises(LoraAdapterError, match="in use by 1 running sequence"):
        engine.unload_lora("c")
    with pytest.raises(LoraAdapterError, match="rank 16, above --max-lora-rank 8"):
        compile_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("refused") / "artifact",
                      CompileConfig(dtype="float32", lora_adapters=(f"w={lora_adapters['wide']}",), max_lora_rank=8))

