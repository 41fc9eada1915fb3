"""Prompt lookup proposes what followed the latest match of the longest suffix."""

from __future__ import annotations

import numpy as np

from tokenmill.speculative.ngram import ngram_lookup


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


def reference_lookup(tokens: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """The definition, written out: for n from max_n down to min_n, the latest earlier
    window equal to the last n tokens; what followed it, continued periodically."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        starts = [s for s in range(0, length - n) if tokens[s:s + n] == suffix]
        if starts:
            start = starts[-1] + n
            proposal = tokens[start:start + k]
            while len(proposal) < k:
                proposal.append(proposal[start + len(proposal) - length])
            return proposal
    return []


def test_matches_the_written_out_definition_on_random_sequences():
    rng = np.random.default_rng(0)
    for case in range(2000):
        length = int(rng.integers(1, 60))
        vocab = int(rng.integers(2, 6))  # few distinct tokens: many partial matches
        tokens = rng.integers(0, vocab, length).tolist()
        max_n = int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        k = int(rng.integers(1, 9))
        assert lookup(tokens, max_n, min_n, k) == reference_lookup(tokens, max_n, min_n, k), \
            (case, tokens, max_n, min_n, k)
