"""Structured output in the engine, on the tiny llama with the real tokenizer.

Outputs are checked by independent definitions of each constraint (jsonschema, re.fullmatch, set
membership); greedy constrained decoding must equal Hugging Face's model decoded greedily over the
tokens a separate xgrammar matcher allows at each position. Parallel samples, beams, speculative
decoding and preemption must keep every output inside its grammar and change nothing else: sample i
of a seeded n > 1 request equals a single request with seed + i, and speculation and preemption leave
greedy outputs as they are.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from octavo.errors import RequestError
from octavo.runtime.beam_search import BeamSearchParams, beam_search
from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.structured.masks import banned_from_bitmask, bitmask_words
from octavo.runtime.structured.matcher import GrammarState
from octavo.runtime.structured.spec import GrammarError, StructuredOutputs
from tests.conftest import assert_pool_full
from tests.runtime.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
    "required": ["name", "count", "kind", "ok"], "additionalProperties": False}
JSON = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"(red|blue)-[0-9]{2,3}"
CHOICES = ["north", "south west", "east"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | [0-9][0-9]'
GRAMMAR_AS_REGEX = r"\(([a-c]|[0-9]{2})(,([a-c]|[0-9]{2}))*\)"
PROMPTS = [[31, 414, 2768, 314], [1267, 12, 7, 99, 5012], [3050]]


@pytest.fixture(scope="module")
def engine(artifact):
    return make_engine(artifact, num_kv_blocks=128, max_model_len=256)


def generate(engine, prompts, params: SamplingParams) -> list:
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{index}")
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    return [finals[f"r{index}"] for index in range(len(prompts))]


def check_text(spec: StructuredOutputs, text: str) -> None:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif spec.kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(GRAMMAR_AS_REGEX, text), text


@pytest.mark.parametrize("spec", [JSON, StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
                                  StructuredOutputs(grammar=GRAMMAR)], ids=["json", "regex", "choice", "grammar"])
def test_greedy_and_sampled_outputs_match_their_constraint(engine, spec):
    bound = 64 if spec.kind == "json" else 24
    for params in (SamplingParams(temperature=0, max_tokens=bound, structured=spec),
                   SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=bound, structured=spec)):
        for output in generate(engine, PROMPTS, params):
            for completion in output.outputs:
                if spec.kind == "grammar" and completion.finish_reason == "length":
                    continue  # "(" item ("," item)* ")" may go on for ever
                assert completion.finish_reason == "stop", completion
                check_text(spec, completion.text)


def test_greedy_equals_hf_over_the_tokens_the_grammar_allows(engine, hf_model, smollm2_source):
    spec = StructuredOutputs(json=SCHEMA)  # any whitespace: many tokens allowed at most positions
    compiled = engine.structured.grammars.compile(spec)
    [output] = generate(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24, structured=spec))
    reference = GrammarState.start(compiled)  # a matcher of its own, advanced by the reference's tokens
    bitmask = torch.zeros(1, bitmask_words(engine.vocab_size), dtype=torch.int32)
    tokens = list(PROMPTS[0])
    for _ in output.outputs[0].token_ids:
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0, -1, :engine.vocab_size]
        reference.fill(bitmask, 0)
        choice = int(logits.masked_fill(banned_from_bitmask(bitmask, engine.vocab_size)[0], float("-inf")).argmax())
        assert reference.accept(choice)
        tokens.append(choice)
    assert output.outputs[0].token_ids == tokens[len(PROMPTS[0]):]


def test_parallel_samples_fork_the_grammar(engine):
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=64, structured=JSON)
    [together] = generate(engine, PROMPTS[:1], params)
    for index, completion in enumerate(together.outputs):
        [alone] = generate(engine, PROMPTS[:1], params.clone(n=1, seed=11 + index))
        assert completion.token_ids == alone.outputs[0].token_ids
        check_text(JSON, completion.text)


def test_beams_stay_inside_the_grammar(engine):
    outputs = beam_search(engine, PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=40, structured=JSON))
    for prompt, output in zip(PROMPTS[:2], outputs, strict=True):
        assert len(output.sequences) == 3
        for hypothesis in output.sequences:
            tokens = hypothesis.tokens[len(prompt):]
            state = GrammarState.start(engine.structured.grammars.compile(JSON))
            assert all(state.accept(token) for token in tokens)  # every hypothesis is a prefix of the language
            if hypothesis.finished_with_eos:
                check_text(JSON, hypothesis.text)
    assert any(h.finished_with_eos for output in outputs for h in output.sequences)
    assert_pool_full(engine)


def test_speculation_and_preemption_leave_greedy_outputs_unchanged(artifact, engine):
    params = SamplingParams(temperature=0, max_tokens=48, structured=JSON)
    prompts = [PROMPTS[0] * 4, PROMPTS[1] * 3, PROMPTS[2] * 9, PROMPTS[0] + PROMPTS[1]]
    expected = [output.outputs[0].token_ids for output in generate(engine, prompts, params)]
    speculating = make_engine(artifact, num_kv_blocks=128, max_model_len=256, speculative="ngram:3:fixed")
    assert [output.outputs[0].token_ids for output in generate(speculating, prompts, params)] == expected
    assert speculating.speculator.stats.proposed_tokens > 0
    small_pool = make_engine(artifact, num_kv_blocks=9, max_model_len=128)
    assert [output.outputs[0].token_ids for output in generate(small_pool, prompts, params)] == expected
    assert small_pool.scheduler.num_preemptions > 0


def test_a_terminated_grammar_finishes_with_ignore_eos_and_min_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=12,
                            structured=StructuredOutputs(choice=CHOICES))
    for output in generate(engine, PROMPTS, params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and completion.token_ids[-1] == engine.eos_token_ids[0]
        assert completion.text in CHOICES


def test_masks_are_computed_on_the_worker_while_the_model_runs(engine):
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, structured=JSON), request_id="w")
    with engine.phases.record() as seconds:
        run_to_completion(engine)
    assert "grammar" in seconds and engine.step_mask is not None
    assert any(thread.name.startswith("octavo-grammar") for thread in threading.enumerate())


def test_a_spec_the_engine_cannot_compile_adds_nothing(engine):
    with pytest.raises(GrammarError, match="parenthesis is not closed") as caught:
        engine.add_request(PROMPTS[0], SamplingParams(structured={"regex": "(ab"}))
    assert caught.value.kind == "regex" and isinstance(caught.value, RequestError)
    assert not engine.has_unfinished_requests() and not engine.requests


def test_a_grammar_no_token_continues_aborts_only_its_own_sequence(engine):
    """After "a" the regex needs U+001D, which no token of the vocabulary holds: that request ends as
    aborted with the text it had; a request beside it in the same batch finishes normally."""
    stuck = SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutputs(regex="a\x1d"))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(PROMPTS[0], stuck, request_id="stuck")
    engine.add_request(PROMPTS[1], free, request_id="free")
    finals = run_to_completion(engine)
    assert_pool_full(engine)
    assert finals["stuck"].outputs[0].finish_reason == "abort" and finals["stuck"].outputs[0].text == "a"
    assert finals["free"].outputs[0].finish_reason == "length" and len(finals["free"].outputs[0].token_ids) == 6


def test_the_compiled_executor_decodes_under_the_grammar_as_the_eager_one(artifact, engine, compiled_cache):
    """The default executor (AOTInductor) with the masks applied to its logits: every constraint kind, greedy,
    the same tokens as the eager engine's (float32)."""
    compiled = make_engine(artifact, num_kv_blocks=128, max_model_len=256, executor="compiled")
    assert compiled.executor_kind == "compiled"
    for spec in (JSON, StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES)):
        params = SamplingParams(temperature=0, max_tokens=64, structured=spec)
        expected = [output.outputs[0].token_ids for output in generate(engine, PROMPTS, params)]
        outputs = generate(compiled, PROMPTS, params)
        assert [output.outputs[0].token_ids for output in outputs] == expected
        for output in outputs:
            check_text(spec, output.outputs[0].text)
