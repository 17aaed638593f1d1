"""The LLM API on a tiny artifact: prompt forms, ordering, per-prompt params, streaming, chat."""

from __future__ import annotations

import pytest

import octavo
from octavo.errors import OctavoError
from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.conftest import assert_pool_full

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Compilers turn programs into"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a compiler?"}]


@pytest.fixture(scope="module")
def llm(tiny_artifact) -> LLM:
    return LLM(tiny_artifact("llama"), num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(autouse=True)
def pool_full_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_pool_full(request.getfixturevalue("llm").engine)


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def test_every_prompt_form_gives_the_same_completion(llm):
    token_ids = llm.tokenizer.encode(TEXT)
    outputs = llm.generate([TEXT, token_ids, {"prompt_token_ids": token_ids}, {"prompt": TEXT}], greedy(8))
    completions = [output.outputs[0] for output in outputs]
    assert all(completion.token_ids == completions[0].token_ids for completion in completions)
    assert all(completion.text == completions[0].text for completion in completions)
    assert len(completions[0].token_ids) == 8 and completions[0].text
    assert [output.prompt for output in outputs] == [TEXT, None, None, TEXT]
    assert all(output.prompt_token_ids == token_ids for output in outputs)


def test_a_prompt_dict_without_a_prompt_is_rejected_alone(llm):
    outputs = llm.generate([{"text": TEXT}, TEXT], greedy(3))
    assert outputs[0].error == "a prompt dict needs a 'prompt' or 'prompt_token_ids' key, got keys ['text']"
    assert outputs[0].outputs == [] and outputs[0].finished
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 3


def test_a_prompt_that_is_neither_text_nor_token_ids_is_rejected_alone(llm):
    outputs = llm.generate([[1, "7"], [2.5], None, TEXT], greedy(3))
    assert [output.error for output in outputs[:3]] == [
        "a prompt is text or a list of integer token ids, got a list of int, str",
        "a prompt is text or a list of integer token ids, got a list of float",
        "a prompt is text or a list of integer token ids, got a NoneType"]
    assert outputs[3].error is None and len(outputs[3].outputs[0].token_ids) == 3
    with pytest.raises(TypeError, match=r"prompts are text, a list of token ids, .*; got int"):
        llm.generate(5, greedy(3))


def test_a_single_prompt_is_accepted_bare(llm):
    token_ids = llm.tokenizer.encode(TEXT)
    from_text = llm.generate(TEXT, greedy(5))
    from_ids = llm.generate(token_ids, greedy(5))
    assert len(from_text) == len(from_ids) == 1
    assert from_text[0].outputs[0].token_ids == from_ids[0].outputs[0].token_ids


def test_outputs_come_in_prompt_order_with_their_own_params(llm):
    prompts = ["One", "Two three four five six seven", "Eight nine"]
    params = [greedy(12), greedy(2), greedy(6)]  # the first finishes last
    outputs = llm.generate(prompts, params)
    assert [output.prompt for output in outputs] == prompts
    assert [len(output.outputs[0].token_ids) for output in outputs] == [12, 2, 6]
    alone = [llm.generate(prompt, param)[0].outputs[0].token_ids for prompt, param in zip(prompts, params,
                                                                                        strict=True)]
    assert [output.outputs[0].token_ids for output in outputs] == alone


def test_params_list_of_the_wrong_length_is_an_error(llm):
    with pytest.raises(OctavoError, match="got 1 sampling params for 2 prompts"):
        llm.generate(["a", "b"], [greedy(2)])


def test_stream_deltas_concatenate_to_what_generate_returns(llm):
    expected = llm.generate(TEXT, greedy(10, stop=["zzzz"]))[0].outputs[0]
    text, token_ids, outputs = "", [], list(llm.stream(TEXT, greedy(10, stop=["zzzz"])))
    for output in outputs:
        text += output.outputs[0].delta_text
        token_ids += output.outputs[0].delta_token_ids
    assert len(outputs) >= 10  # a prefill step then one step per token
    assert [output.finished for output in outputs] == [False] * (len(outputs) - 1) + [True]
    assert text == outputs[-1].outputs[0].text == expected.text
    assert token_ids == expected.token_ids


def test_closing_a_stream_early_aborts_the_request(llm):
    stream = llm.stream(TEXT, greedy(50))
    first = next(stream)
    assert not first.finished
    stream.close()
    assert not llm.engine.has_unfinished_requests()  # pool_full_after checks the blocks


def test_stream_of_a_rejected_prompt_yields_its_error(llm):
    outputs = list(llm.stream(list(range(5, 600)), greedy(3)))
    assert len(outputs) == 1 and outputs[0].finished and "max_model_len" in outputs[0].error


def test_chat_uses_the_tokenizers_chat_template(llm):
    expected_ids = llm.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert llm.apply_chat_template(MESSAGES) == expected_ids
    rendered = llm.tokenizer.decode(expected_ids)
    assert rendered.endswith("<|im_start|>assistant\n") and "What is a compiler?" in rendered
    [reply] = llm.chat(MESSAGES, greedy(6))
    assert reply.prompt_token_ids == expected_ids
    assert reply.outputs[0].token_ids == llm.generate(expected_ids, greedy(6))[0].outputs[0].token_ids


def test_chat_over_several_conversations(llm):
    second = [{"role": "user", "content": "Hi"}]
    replies = llm.chat([MESSAGES, second], greedy(4))
    assert [reply.prompt_token_ids for reply in replies] == [llm.apply_chat_template(MESSAGES),
                                                             llm.apply_chat_template(second)]


def test_unknown_engine_option_lists_the_known_ones(tiny_artifact):
    with pytest.raises(OctavoError, match=r"unknown engine option\(s\) max_batch; known: .*max_num_seqs"):
        LLM(tiny_artifact("llama"), max_batch=4)


def test_octavo_load_is_the_llm(tiny_artifact):
    llm = octavo.load(tiny_artifact("llama"), num_kv_blocks=8)
    assert isinstance(llm, LLM)
    [output] = llm.generate([5, 6, 7], octavo.SamplingParams(temperature=0, max_tokens=3))
    assert len(output.outputs[0].token_ids) <= 3 and output.outputs[0].finish_reason in ("stop", "length")
    assert_pool_full(llm.engine)
