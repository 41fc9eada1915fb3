"""Prompt lookup proposes what followed the latest match of the longest suffix."""

from __future__ import annotations

import numpy as np

from tokenmill.spec.ngram import ngram_lookup


def lookup(tokens, max_n=4, min_n=2, k=3):
    return ngram_lookup(np.asarray(tokens, dtype=np.int64), max_n, min_n, k)


def test_longest_suffix_and_latest_match_win():
    # "1 2 3" occurs twice before the end; the later occurrence was followed by 9 9.
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3]) == [9, 9, 1]
    # The 3-token suffix "7 1 2" matches once (-> 8); the 2-token "1 2" would say 5.
    assert lookup([7, 1, 2, 8, 0, 1, 2, 5, 6, 7, 1, 2], max_n=3) == [8, 0, 1]


def test_no_match_or_too_short_proposes_nothing():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([1]) == []
    assert lookup([4, 4], min_n=2) == []


def test_periodic_text_continues_into_its_own_proposal():
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], k=7) == [3, 1, 2, 3, 1, 2, 3]
    assert lookup([5, 5, 5, 5], min_n=1, k=3) == [5, 5, 5]
