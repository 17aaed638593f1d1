"""Sequence's in-place view of its output tokens, against the list slice it stands for."""

import pytest

from octavo.runtime.sequence import OutputTokenIds


def test_the_view_reads_what_the_slice_holds_and_follows_later_tokens():
    tokens = [5, 6, 7, 1, 2]
    view = OutputTokenIds(tokens, 3)
    assert (len(view), list(view), view[0], view[-1], view[:1], view[::-1]) == (2, [1, 2], 1, 2, [1], [2, 1])
    assert bool(view) and 2 in view and 7 not in view
    tokens += [3, 4]
    assert list(view) == tokens[3:] and view[-1] == 4 and len(view) == 4
    for index in (4, -5):
        with pytest.raises(IndexError):
            view[index]


def test_every_slice_of_the_view_is_the_slice_of_the_output_list():
    tokens = [9, 8, 10, 11, 12, 13, 14]
    view, output = OutputTokenIds(tokens, 2), tokens[2:]
    bounds = [None, *range(-7, 8)]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1, 2, 3, -1, -2, -4):
                assert view[start:stop:step] == output[start:stop:step], (start, stop, step)


def test_an_empty_output_is_false_and_has_no_last_token():
    view = OutputTokenIds([5, 6], 2)
    assert not view and len(view) == 0 and list(view) == []
    with pytest.raises(IndexError):
        view[-1]
