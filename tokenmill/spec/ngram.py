"""Prompt-lookup (n-gram) proposals: no model, only the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, find the most recent
earlier occurrence of the last n tokens in prompt + output and propose the tokens
that followed it (continuing into the proposal itself when the match is closer to
the end than k tokens, as in periodic text). Code and input-grounded text repeat themselves, so this often
guesses right at the cost of a search; when nothing matches it proposes nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.engine.request import Request
from tokenmill.spec.base import Proposal, Proposer


def ngram_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows that start before the suffix itself and have a token after them.
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            proposal = tokens[start:start + k].tolist()
            # A match close to the end runs into the proposal itself (periodic text):
            # keep copying, from the proposed tokens.
            while len(proposal) < k:
                proposal.append(proposal[start + len(proposal) - length])
            return proposal
    return []


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(ngram_lookup(np.asarray(r.all_token_ids, dtype=np.int64),
                                      self.max_n, self.min_n, k))
                for r, k in zip(requests, num_tokens, strict=True)]
