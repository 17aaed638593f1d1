"""Ops that write arguments in place: every way of calling them writes and returns the same.

octavo::paged_attention writes its caches (and, for quantized caches, the scale caches, which are
optional): calls that omit the optional ones, pass them positionally or by keyword must all work on
every supported torch (2.11's custom_op could not take an omitted one), torch.export's functional
form must keep the writes, and fake tensors must give the output's shape.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import octavo.ir.ops  # noqa: F401  (registers the octavo ops)
from octavo.ir.ops.attention import paged_attention as paged_attention_function

paged_attention = torch.ops.octavo.paged_attention.default


def step(dtype: torch.dtype = torch.float32):
    """Three tokens of one sequence into an empty cache of 2 blocks of 4 (slots 0..2)."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, heads, 8, generator=generator) for heads in (2, 1, 1))
    caches = [torch.zeros(2, 4, 1, 8, dtype=dtype) for _ in range(2)]
    metadata = (torch.arange(3), torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                torch.tensor([0, 3], dtype=torch.int32), 0.35)
    return query, key, value, caches, metadata


def test_the_schema_names_every_written_argument():
    written = [argument.name for argument in paged_attention._schema.arguments
               if argument.alias_info is not None and argument.alias_info.is_write]
    assert written == ["key_cache", "value_cache", "key_scale_cache", "value_scale_cache"]


def test_omitted_positional_and_keyword_scale_caches_give_the_same_step():
    outputs, written = [], []
    for call in ("omitted", "positional", "keyword", "function"):
        query, key, value, (key_cache, value_cache), metadata = step()
        arguments = (query, key, value, key_cache, value_cache, *metadata)
        if call == "omitted":
            out = paged_attention(*arguments)
        elif call == "positional":
            out = paged_attention(*arguments, -1, None, None)
        elif call == "keyword":
            out = paged_attention(*arguments, sliding_window=-1, key_scale_cache=None, value_scale_cache=None)
        else:
            out = paged_attention_function(*arguments)
        outputs.append(out)
        written.append((key_cache, value_cache))
        assert torch.equal(key_cache.view(-1, 1, 8)[:3], key) and torch.equal(value_cache.view(-1, 1, 8)[:3], value)
        assert not key_cache.view(-1, 1, 8)[3:].any()
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_quantized_caches_by_keyword_write_their_scales():
    query, key, value, (key_cache, value_cache), metadata = step(torch.int8)
    key_scales, value_scales = torch.zeros(2, 4, 1), torch.zeros(2, 4, 1)
    paged_attention(query, key, value, key_cache, value_cache, *metadata, key_scale_cache=key_scales,
                    value_scale_cache=value_scales)
    expected = key.abs().amax(-1) / 127
    torch.testing.assert_close(key_scales.view(-1, 1)[:3], expected, rtol=0, atol=0)
    assert not key_scales.view(-1, 1)[3:].any() and value_scales.view(-1, 1)[:3].all()


def test_fake_tensors_give_the_output_shape():
    query, key, value, (key_cache, value_cache), metadata = step()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(tensor) for tensor in (query, key, value, key_cache, value_cache)]
        out = paged_attention(*fakes, *metadata)
    assert out.shape == query.shape and out.dtype == query.dtype


def test_export_keeps_the_cache_writes():
    class Step(torch.nn.Module):
        def forward(self, query, key, value, key_cache, value_cache, slots, tables, lens, starts):
            return paged_attention(query, key, value, key_cache, value_cache, slots, tables, lens, starts, 0.35)

    query, key, value, (key_cache, value_cache), metadata = step()
    program = torch.export.export(Step(), (query, key, value, key_cache, value_cache, *metadata[:4]))
    program = program.run_decompositions({})  # functional: the writes become outputs the caches are updated from
    mutated = set(program.graph_signature.user_inputs_to_mutate.values())
    assert mutated == {"key_cache", "value_cache"}
    program.module()(query, key, value, key_cache, value_cache, *metadata[:4])
    assert torch.equal(key_cache.view(-1, 1, 8)[:3], key)
