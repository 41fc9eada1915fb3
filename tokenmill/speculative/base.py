"""The proposer interface every speculative method implements (worker side).

A proposer guesses the next few tokens of running requests; the target model then
checks all guesses of all requests in one forward pass (`layers/rejection_sampler.py`).
Proposers live in the worker, beside the model, and own whatever state they need (a
draft model's paged KV, an EAGLE head's features); they see requests only as plain
`ProposalRequest`s. They must tolerate rollback: after verification a request's
tokens may end earlier than what the proposer last saw, and the proposer has to
notice that from the request's token ids and drop the stale tail of its state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.core.step import ProposalRequest
from tokenmill.layers.sampler import position_uniform, sorted_inverse_cdf

# Most verified positions one catch-up runs for a request: after a longer gap (a new
# prompt, or a stretch without speculation) a stateful proposer restarts on the
# latest ones. Bounds what the first speculative step costs when the guard turns
# speculation back on; it changes drafts, never output.
MAX_CATCH_UP = 64


@dataclass
class Proposal:
    token_ids: list[int]
    # [len(token_ids), vocab] float32: the draft distribution q each token was drawn
    # from, after the request's own temperature / min-p / top-k / top-p processing
    # (`layers/rejection_sampler.processed_probs`). None when the proposal is
    # deterministic (n-gram lookup, or greedy requests): q is then one-hot.
    probs: torch.Tensor | None = None


class Proposer(ABC):
    name: str
    # True: the engine calls observe() with the target's hidden states.
    needs_hidden_states: bool = False

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        """Up to requests[i].num_tokens (>= 1) draft tokens continuing its token ids.

        May return fewer (or none) for a request: nothing is lost, that request just
        decodes one token this step.
        """

    def observe(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """Target hidden states (after the final norm, [n, hidden]) of positions
        first_position .. first_position + n - 1 of the request, whose tokens are now
        verified (prefill chunks and accepted decode positions)."""
        return None  # only feature-level proposers (EAGLE) need them

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: drop its state and free its KV."""
        return None  # stateless proposers (n-gram) hold nothing

    def check_integrity(self, idle: bool = False) -> None:
        """Check the proposer's own cache structures; idle: no request holds any."""
        return None

    def memory_bytes(self) -> tuple[int, int]:
        """(weight bytes, KV cache bytes) the proposer holds beside the target."""
        return 0, 0


class DraftSampler:
    """Draws sampled requests' draft tokens from q.

    A seeded request's draft for sequence position t uses the uniform its verification
    will draw the target's token at t with (layers/sampler.py `position_uniform`): the
    two draws are coupled, so a draft close to the target agrees with it more often
    (seeded requests are verified by sampling and comparing, which keeps their output
    identical to plain sampling). Unseeded requests share one generator.
    """

    def __init__(self, seed: int) -> None:
        self.shared = torch.Generator().manual_seed(seed)

    def draw(self, q: torch.Tensor, request: ProposalRequest, position: int) -> int:
        seed = request.params.seed
        if seed is None:
            return int(torch.multinomial(q.cpu(), 1, generator=self.shared))
        return sorted_inverse_cdf(q, position_uniform(seed, request.sample_index, position))
