"""octavo::all_reduce and octavo::all_gather: single-process definition, fake shapes, per-rank references."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from octavo.errors import OctavoError
from octavo.ir.ops.collectives import all_gather_reference, all_reduce_reference

octavo = torch.ops.octavo


def test_a_group_of_one_rank_returns_its_input_as_a_new_tensor():
    x = torch.randn(3, 5)
    for result in (octavo.all_reduce(x, "tp", 1), octavo.all_gather(x, "tp", 1, -1)):
        torch.testing.assert_close(result, x, rtol=0, atol=0)
        assert result.data_ptr() != x.data_ptr()


def test_several_ranks_need_the_distributed_runtime():
    with pytest.raises(OctavoError, match="over 2 ranks of group 'tp' runs only in the distributed runtime"):
        octavo.all_reduce(torch.ones(2), "tp", 2)
    with pytest.raises(OctavoError, match="world_size must be >= 1"):
        octavo.all_gather(torch.ones(2), "tp", 0, 0)


def test_fake_shapes():
    with FakeTensorMode():
        x = torch.empty(4, 7, dtype=torch.bfloat16)
        reduced = octavo.all_reduce(x, "tp", 3)
        gathered = octavo.all_gather(x, "tp", 3, -1)
        rows = octavo.all_gather(x, "tp", 3, 0)
    assert (reduced.shape, reduced.dtype) == ((4, 7), torch.bfloat16)
    assert gathered.shape == (4, 21) and rows.shape == (12, 7)


def test_references_sum_and_join_every_ranks_value_in_rank_order():
    values = [torch.full((2, 2), float(rank + 1)) for rank in range(3)]
    torch.testing.assert_close(all_reduce_reference(values), torch.full((2, 2), 6.0), rtol=0, atol=0)
    joined = all_gather_reference(values, dim=1)
    assert joined.shape == (2, 6) and joined[0].tolist() == [1, 1, 2, 2, 3, 3]
