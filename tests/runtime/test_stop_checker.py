"""check_stop and held_back_length: each rule of vLLM's stop checking, and streaming properties."""

from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.runtime.sampling_params import SamplingParams
from octavo.runtime.stop_checker import StopDecision, check_stop, held_back_length

EOS = (0, 9)
NOT_FINISHED = StopDecision(False, None, None, None)


def decide(params, output_ids, text="", new_text_len=0, prompt_len=3, max_model_len=1000):
    total_tokens = prompt_len + len(output_ids)
    return check_stop(params, EOS, output_ids, text, new_text_len, total_tokens, max_model_len)


def test_running_sequence_is_not_finished():
    assert decide(SamplingParams(), [5, 6], "ab", 1) == NOT_FINISHED


def test_eos_stops_without_reason():
    for eos in EOS:
        assert decide(SamplingParams(), [5, eos]) == StopDecision(True, "stop", None, None)


def test_eos_text_is_removed_unless_included():
    # With skip_special_tokens=False the EOS adds text, which vLLM removes from the output.
    text = "hi<|im_end|>"
    assert decide(SamplingParams(), [5, 0], text, 10) == StopDecision(True, "stop", None, 2)
    kept = decide(SamplingParams(include_stop_str_in_output=True), [5, 0], text, 10)
    assert kept == StopDecision(True, "stop", None, None)


def test_ignore_eos():
    params = SamplingParams(ignore_eos=True, max_tokens=3)
    assert decide(params, [5, 0]) == NOT_FINISHED
    assert decide(params, [5, 0, 0]) == StopDecision(True, "length", None, None)


def test_stop_token_ids_report_the_token():
    params = SamplingParams(stop_token_ids=[7, 8])
    assert decide(params, [5, 8], "a\n", 1) == StopDecision(True, "stop", 8, 1)
    assert decide(params.clone(include_stop_str_in_output=True), [5, 7], "a\n", 1).truncate_text_to is None
    # EOS is checked first.
    assert decide(SamplingParams(stop_token_ids=[0]), [5, 0]).stop_reason is None


def test_stop_string_truncates_before_it():
    params = SamplingParams(stop=["###"])
    assert decide(params, [1, 2], "Answer: 42###", 5) == StopDecision(True, "stop", "###", 10)
    # Text after the stop string in the same delta is dropped too.
    assert decide(params, [1, 2], "Answer###more", 7) == StopDecision(True, "stop", "###", 6)


def test_stop_string_included_in_output():
    params = SamplingParams(stop=["###"], include_stop_str_in_output=True)
    assert decide(params, [1, 2], "Answer: 42###", 5) == StopDecision(True, "stop", "###", None)
    assert decide(params, [1, 2], "Answer###more", 7) == StopDecision(True, "stop", "###", 9)


def test_stop_string_spanning_previous_and_new_text():
    params = SamplingParams(stop=["###"])
    assert decide(params, [1, 2], "abc###", 1) == StopDecision(True, "stop", "###", 3)


def test_only_text_that_could_hold_a_new_match_is_searched():
    params = SamplingParams(stop=["###"])
    # "###" ends before the last 3 characters' reach: it was already there before this delta.
    assert decide(params, [1, 2], "xx###yy", 2) == NOT_FINISHED
    assert decide(params, [1, 2], "xx###yy", 3) == StopDecision(True, "stop", "###", 2)
    assert decide(params, [1, 2], "xx###yy", 0) == NOT_FINISHED


def test_earliest_stop_string_wins():
    params = SamplingParams(stop=["later", "ear"])
    assert decide(params, [1], "the earlier", 11) == StopDecision(True, "stop", "ear", 4)


def test_min_tokens_defers_stops_but_not_length_limits():
    params = SamplingParams(min_tokens=3, stop=["!"], stop_token_ids=[7])
    assert decide(params, [5, 0]) == NOT_FINISHED
    assert decide(params, [5, 7]) == NOT_FINISHED
    assert decide(params, [5, 6], "a!", 1) == NOT_FINISHED
    assert decide(params, [5, 6, 0]) == StopDecision(True, "stop", None, None)
    assert decide(params, [5, 6, 7]) == StopDecision(True, "stop", 7, None)
    assert decide(params, [5, 6], "a!", 1, prompt_len=8, max_model_len=10).finish_reason == "length"


def test_max_tokens():
    assert decide(SamplingParams(max_tokens=2), [5]) == NOT_FINISHED
    assert decide(SamplingParams(max_tokens=2), [5, 6]) == StopDecision(True, "length", None, None)
    assert decide(SamplingParams(max_tokens=None), [5] * 500) == NOT_FINISHED
    # A stop condition on the last allowed token is reported as a stop.
    assert decide(SamplingParams(max_tokens=2), [5, 0]).finish_reason == "stop"


def test_max_model_len():
    params = SamplingParams(max_tokens=None)
    assert decide(params, [5, 6], prompt_len=7, max_model_len=10) == NOT_FINISHED
    assert decide(params, [5, 6], prompt_len=8, max_model_len=10) == StopDecision(True, "length", None, None)


def test_held_back_length():
    assert held_back_length(SamplingParams()) == 0
    assert held_back_length(SamplingParams(stop=["a", "abcd"])) == 3
    assert held_back_length(SamplingParams(stop=["a"])) == 0
    assert held_back_length(SamplingParams(stop=["abcd"], include_stop_str_in_output=True)) == 0


stop_strings = st.lists(st.text("ab#", min_size=1, max_size=4), min_size=1, max_size=3)
text_chunks = st.lists(st.text("ab#", min_size=0, max_size=4), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(stops=stop_strings, chunks=text_chunks, include=st.booleans())
def test_streaming_matches_whole_text_search(stops, chunks, include):
    """Feeding text delta by delta stops where a search of the whole text first finds a stop string,
    and a client shown all but the held-back tail never sees text that is later cut off."""
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=None)
    text, shown_prefixes, decision = "", [], NOT_FINISHED
    for count, chunk in enumerate(chunks, start=1):
        text += chunk
        decision = check_stop(params, EOS, [5] * count, text, len(chunk), count, 10_000)
        if decision.finished:
            break
        shown_prefixes.append(text[: max(0, len(text) - held_back_length(params))])
    final_text = text if decision.truncate_text_to is None else text[: decision.truncate_text_to]

    matches = [(text.find(stop), stop) for stop in stops if stop in text]
    if not matches:
        assert not decision.finished and final_text == text
    else:
        start = min(position for position, _ in matches)
        assert decision.finished and decision.finish_reason == "stop"
        assert decision.stop_reason in stops and text.find(decision.stop_reason) == start
        assert final_text == text[: start + (len(decision.stop_reason) if include else 0)]
    assert all(final_text.startswith(prefix) for prefix in shown_prefixes)
