"""Sampler(logits, rows, logprob_rows): logprobs only for the listed rows, the same tokens for all.

The reference is the sampler's own full call (every row's logprobs), whose semantics
tests/runtime/test_sampler*.py check against their definitions.
"""

from __future__ import annotations

import math

import torch

from octavo.runtime.sampler import Sampler, SamplingRow
from octavo.runtime.sampling_params import SamplingParams

VOCAB = 40


def rows() -> list[SamplingRow]:
    """Greedy and seeded random rows, with and without logprobs, penalties and bias."""
    return [
        SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3], None),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=3), [4], [], None),
        SamplingRow(SamplingParams(temperature=0.9, top_p=0.8, seed=5), [1], [2, 2],
                    torch.Generator().manual_seed(5)),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={7: 3.0}, logprobs=5),
                    [7, 8], [9], None),
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=4), [1], [], None),
    ]


def test_listed_rows_match_the_full_call_and_the_others_are_marked_missing():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    full = Sampler(VOCAB, [2], seed=1)(logits, rows())
    listed = [1, 3]
    partial = Sampler(VOCAB, [2], seed=1)(logits, rows(), logprob_rows=listed)
    assert torch.equal(partial.token_ids, full.token_ids)
    for row in range(5):
        if row in listed:
            assert partial.sampled_logprobs[row] == full.sampled_logprobs[row]
            assert partial.sampled_ranks[row] == full.sampled_ranks[row]
            assert torch.equal(partial.top_logprobs[row], full.top_logprobs[row])
            assert torch.equal(partial.top_token_ids[row], full.top_token_ids[row])
        else:
            assert math.isnan(partial.sampled_logprobs[row]) and partial.sampled_ranks[row] == 0
            assert partial.top_logprobs[row].isnan().all() and (partial.top_token_ids[row] == -1).all()


def test_no_listed_rows_computes_no_logprobs_but_the_same_tokens():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    full = Sampler(VOCAB, [2], seed=1)(logits, rows())
    none = Sampler(VOCAB, [2], seed=1)(logits, rows(), logprob_rows=[])
    assert torch.equal(none.token_ids, full.token_ids)
    assert none.sampled_logprobs.isnan().all() and none.top_logprobs.shape == full.top_logprobs.shape


def test_engine_rows_without_logprobs_report_no_cumulative_logprob(artifact):
    """The engine asks only for the logprobs a request shows; a request without them reports none."""
    from tests.runtime.engine_helpers import greedy, make_engine, run_to_completion

    engine = make_engine(artifact)
    engine.add_request([5, 6, 7, 8], greedy(4), request_id="plain")
    engine.add_request([5, 6, 7, 8], greedy(4, logprobs=2), request_id="with")
    outputs = run_to_completion(engine)
    plain, with_logprobs = outputs["plain"].outputs[0], outputs["with"].outputs[0]
    assert plain.token_ids == with_logprobs.token_ids
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert with_logprobs.cumulative_logprob == sum(entry[token].logprob for entry, token
                                                   in zip(with_logprobs.logprobs, with_logprobs.token_ids, strict=True))
