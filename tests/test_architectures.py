"""Every architecture the tests build (tests/tiny_models.TINY_MODELS) matches Hugging Face step by step.

float32: five sequences of different lengths run concurrently under a small
token budget and a small KV pool, so steps mix decodes, whole prefills and
chunks of long prefills, requests arrive while others are decoding, a late
request finds the first blocks of an earlier one's prompt in the prefix cache,
and the pool runs out so that sequences are preempted and recomputed. Every
sampled row's logits must equal HF eager's on the same context (max abs
difference <= 1e-4, the float32 bound of docs/architecture.md "Numerics"),
which makes the greedy tokens HF's; one request also scores its prompt
(prompt_logprobs), whose log probabilities must equal HF's log_softmax.

Mixtures of experts: the experts chosen for every token of a prompt (prefilled in one step) and of the
decode steps after it are exactly the ones HF's router chooses (test_moe_routing_is_hfs).

bfloat16: a shorter run of the same kind, where each sampled row's logits must
be as close to the exact (HF float32) logits as HF's own bfloat16 run is, within
a factor BF16_ERROR_FACTOR: both runs round the same arithmetic to bf16, in other
orders, so their errors are of one size (see test_bfloat16_logits_as_close_as_hfs).

Every architecture runs on the eager executor (node by node); the windowed one
(mistral) also on the compiled executor (AOTInductor, whose decode steps run
padded to the batch-size ladder 1, 2, 4, 8: three to five decoding sequences
pad). One Inductor compile per architecture would cost ~10 s each; the other
architectures differ from it only in ops the compiled executor treats alike
(biases, q/k norms), and tests/runtime/test_compiled_executor.py covers
llama and quantized artifacts.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from octavo.config import EngineConfig
from octavo.frontend.architectures import architecture_for
from octavo.ir.ops.moe import route
from octavo.runtime.engine import LLMEngine
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full
from tests.tiny_models import MIXTURES_OF_EXPERTS, NEW_DENSE_FAMILIES, TINY_MODELS, TINY_WINDOW

PROMPT_LENGTHS = [5, 47, 12, 40, 3]
MAX_TOKENS = [9, 6, 12, 8, 10]
SHARED_PREFIX = 32  # request 3's prompt starts with request 1's first two blocks
LATE_REQUESTS, LATE_STEP = (3, 4), 3
SCORED = 2  # the request that asks for prompt_logprobs
NUM_TOP = 4
TOKEN_BUDGET = 20
KV_BLOCKS = 6  # fewer than the five sequences need together: some are preempted
FLOAT32_TOLERANCE = 1e-4
BF16_ERROR_FACTOR = 2.0


def make_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49000, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]
    prompts[3][:SHARED_PREFIX] = prompts[1][:SHARED_PREFIX]
    return prompts


def hf_model(directory, dtype: torch.dtype):
    """HF's model as the reference runs it: eager attention (the one that computes every feature) in `dtype`."""
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=dtype).eval()


def last_logits(model, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([context]), logits_to_keep=1).logits[0, -1].float()


@pytest.mark.parametrize(("model_type", "executor"),
                         [(model_type, "eager") for model_type in TINY_MODELS] + [("mistral", "compiled")])
def test_logits_match_hf_eager_step_by_step(model_type, executor, tiny_model_dir, tiny_artifact, compiled_cache):
    reference = hf_model(tiny_model_dir(model_type), torch.float32)
    engine = LLMEngine(tiny_artifact(model_type), EngineConfig(num_kv_blocks=KV_BLOCKS, max_num_seqs=8,
                                                               max_num_batched_tokens=TOKEN_BUDGET, executor=executor))
    assert engine.executor_kind == executor
    prompts = make_prompts()
    finals = {}
    worst, compared, step, kinds, preempted = 0.0, 0, 0, set(), 0
    for index in range(len(prompts)):
        if index not in LATE_REQUESTS:
            add_request(engine, prompts, index)
    while engine.has_unfinished_requests():
        if step == LATE_STEP:  # late arrivals join while the first requests decode and prefill
            for index in LATE_REQUESTS:
                add_request(engine, prompts, index)
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        record = engine.last_step
        kinds.add(_step_kind(record))
        preempted += len(record.schedule.preempted)
        if (engine.runner.last_size or 0) > len(record.schedule.scheduled):
            kinds.add("padded decode")
        for row, scheduled_index in enumerate(record.inputs.sampled_rows):
            seq = record.schedule.scheduled[scheduled_index].seq
            expected = last_logits(reference, seq.token_ids[:seq.num_computed_tokens])
            worst = max(worst, (expected - record.logits[row].float()).abs().max().item())
            compared += 1
        step += 1
    assert worst <= FLOAT32_TOLERANCE, f"max abs logits difference {worst}"
    assert compared >= sum(MAX_TOKENS)  # preempted sequences sample their recomputed tokens again
    assert "decode+chunked-prefill" in kinds, kinds
    assert ("padded decode" in kinds) == (executor == "compiled"), kinds
    assert preempted, "the small pool was meant to preempt"
    assert engine.block_manager.prefix_cache_hits_tokens >= SHARED_PREFIX, "request 3 was meant to hit the cache"
    check_prompt_logprobs(finals[str(SCORED)].prompt_logprobs, prompts[SCORED], reference)
    assert_pool_full(engine)
    windows = engine.artifact.kv_layout["sliding_windows"]
    expected_windows = architecture_for(reference.config).sliding_windows(reference.config)
    assert windows == expected_windows
    if any(window > 0 for window in windows):  # the window must actually cut the context of the longest sequences
        assert TINY_WINDOW in windows and max(PROMPT_LENGTHS) + max(MAX_TOKENS) > TINY_WINDOW


def add_request(engine: LLMEngine, prompts: list[list[int]], index: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[index], ignore_eos=True,
                            prompt_logprobs=NUM_TOP if index == SCORED else None)
    engine.add_request(prompts[index], params, request_id=str(index))


def check_prompt_logprobs(entries, prompt: list[int], reference) -> None:
    """Each prompt token's log probability (and the top NUM_TOP) equal HF's log_softmax at the previous position."""
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = entries[position], expected[position - 1]
        token = prompt[position]
        assert abs(entry[token].logprob - row[token].item()) <= FLOAT32_TOLERANCE
        for top_token in row.topk(NUM_TOP).indices.tolist():
            assert abs(entry[top_token].logprob - row[top_token].item()) <= FLOAT32_TOLERANCE


class MoeCalls(TorchDispatchMode):
    """Records the (x, router_weight, top_k, normalize) of every moe kernel the engine runs, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.endswith("::moe"):
            self.calls.append(tuple(arg.clone() if isinstance(arg, torch.Tensor) else arg for arg in args[:6]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model_type", MIXTURES_OF_EXPERTS)
def test_moe_routing_is_hfs(model_type, tiny_model_dir, tiny_artifact):
    """Octavo's routing (the op's definition applied to the hidden states each moe call receives; the kernels
    route as the definition does, tests/codegen) picks, for every token and layer, the experts HF picks."""
    reference = hf_model(tiny_model_dir(model_type), torch.float32)
    layers = reference.config.num_hidden_layers
    chosen: dict[int, list] = {layer: [] for layer in range(layers)}
    hooks = [reference.model.layers[layer].mlp.gate.register_forward_hook(
        lambda module, inputs, output, layer=layer: chosen[layer].append(output[2]))
        for layer in range(layers)]
    engine = LLMEngine(tiny_artifact(model_type), EngineConfig(num_kv_blocks=16, max_num_batched_tokens=64,
                                                               executor="eager"))
    prompt = make_prompts()[1]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    recorder = MoeCalls()
    with recorder:
        while engine.has_unfinished_requests():
            engine.step()
    steps = [recorder.calls[index:index + layers] for index in range(0, len(recorder.calls), layers)]
    assert len(steps) == 4 and len(steps[0][0][0]) == len(prompt)  # the prompt in one step, then 3 decodes
    tokens = engine.last_step.schedule.scheduled[0].seq.token_ids
    with torch.no_grad():
        reference(torch.tensor([tokens[:len(prompt) + 3]]))
    for step, calls in enumerate(steps):
        rows = slice(0, len(prompt)) if step == 0 else slice(len(prompt) + step - 1, len(prompt) + step)
        for layer, (x, router_weight, _, _, top_k, normalize) in enumerate(calls):
            _, experts = route(x, router_weight, top_k, normalize, torch.float32)
            assert torch.equal(experts, chosen[layer][-1][rows]), f"step {step}, layer {layer}"
    for hook in hooks:
        hook.remove()
    assert_pool_full(engine)


@pytest.mark.parametrize("model_type", NEW_DENSE_FAMILIES + MIXTURES_OF_EXPERTS)
def test_bfloat16_logits_as_close_as_hfs(model_type, tiny_model_dir, tiny_quantized_artifact):
    """Each sampled row: |octavo_bf16 - hf_fp32| <= BF16_ERROR_FACTOR * max|hf_bf16 - hf_fp32| (per step).

    HF's bfloat16 run is the precision a user of the model accepts: its logits differ from the exact
    (float32) ones by the rounding of every bf16 intermediate. Octavo runs the same op sequence in bf16
    except inside its kernels (attention sums in float32 in another order, Triton/C++ round once), so
    its rounding errors are of the same size and sign-independent of HF's: their difference to the
    exact logits is bounded by the sum of two such errors, hence a factor 2 on HF's own error. A
    kernel computing something else (a missing soft-cap, a norm weight applied in the wrong order)
    gives errors of the size of the feature itself, far above this.
    """
    directory = tiny_model_dir(model_type)
    exact, hf_bf16 = hf_model(directory, torch.float32), hf_model(directory, torch.bfloat16)
    engine = LLMEngine(tiny_quantized_artifact(model_type, dtype="bfloat16"),
                       EngineConfig(num_kv_blocks=32, max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=8))
    prompts = make_prompts()
    for index in (0, 1, 2):
        engine.add_request(prompts[index], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    compared = 0
    while engine.has_unfinished_requests():
        engine.step()
        record = engine.last_step
        for row, scheduled_index in enumerate(record.inputs.sampled_rows):
            seq = record.schedule.scheduled[scheduled_index].seq
            context = seq.token_ids[:seq.num_computed_tokens]
            truth = last_logits(exact, context)
            hf_error = (last_logits(hf_bf16, context) - truth).abs().max().item()
            error = (record.logits[row].float() - truth).abs().max().item()
            assert error <= BF16_ERROR_FACTOR * hf_error, (
                f"octavo bf16 is {error:.4f} from the float32 logits, HF bf16 {hf_error:.4f}")
            compared += 1
    assert compared == 12
    assert_pool_full(engine)


def _step_kind(record) -> str:
    decodes = sum(1 for item in record.schedule.scheduled if item.num_new_tokens == 1)
    chunks = sum(1 for item in record.schedule.scheduled if item.num_new_tokens > 1 and not item.samples)
    if decodes and chunks:
        return "decode+chunked-prefill"
    return "other"
