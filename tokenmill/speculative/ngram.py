"""Prompt-lookup (n-gram) proposals: no model, only the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, find the most recent
earlier occurrence of the last n tokens in prompt + output and propose the tokens
that followed it (continuing into the proposal itself when the match is closer to
the end than k tokens, as in periodic text). Code and input-grounded text repeat themselves, so this often
guesses right at the cost of a search; when nothing matches it proposes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.core.step import ProposalRequest
from tokenmill.speculative.base import Proposal, Proposer

if TYPE_CHECKING:
    from tokenmill.speculative.factory import ProposerContext


def ngram_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix.

    One pass finds the earlier positions holding the last token; each such position
    then extends its match backwards one token at a time (at most max_n - 1 more
    comparisons over the candidates, not over the sequence)."""
    length = len(tokens)
    if length < 2:
        return []
    # Candidate match ends: earlier positions (before the last token) equal to it.
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    if not len(ends):
        return []
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched at each end
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_n):
        earlier = ends - back
        alive &= earlier >= 0
        alive[alive] &= tokens[earlier[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    n = int(matched.max())
    if n < min_n:
        return []
    start = int(ends[np.flatnonzero(matched == n)[-1]]) + 1
    proposal = tokens[start:start + k].tolist()
    # A match close to the end runs into the proposal itself (periodic text): keep
    # copying, from the proposed tokens.
    while len(proposal) < k:
        proposal.append(proposal[start + len(proposal) - length])
    return proposal


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(ngram_lookup(np.asarray(r.token_ids, dtype=np.int64),
                                      self.max_n, self.min_n, r.num_tokens))
                for r in requests]


def proposer_footprint(context: ProposerContext) -> None:
    return None  # no model: nothing in the KV pool or the weights


def build_proposer(context: ProposerContext) -> NgramProposer:
    spec = context.config.spec
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)
