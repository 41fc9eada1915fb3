"""The EAGLE proposer: drafts with an EAGLE head (head.py) over its own paged KV pool,
fed the target's hidden states by the worker (`observe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.step import ProposalRequest, ScheduledRequest
from tokenmill.layers.linear import LinearSelector, weight_bytes
from tokenmill.layers.rejection_sampler import processed_probs
from tokenmill.layers.sampler import greedy
from tokenmill.model.arch import ArchConfig
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.speculative.base import MAX_CATCH_UP, DraftSampler, Proposal, Proposer
from tokenmill.speculative.eagle.checkpoint import load_eagle_head, read_head_config
from tokenmill.speculative.eagle.head import EagleHead
from tokenmill.speculative.factory import ProposerContext, ProposerFootprint


@dataclass(eq=False)
class _DraftSequence:
    """The head's view of one request (a `Sequence` to the head's KVCacheManager).

    Head position i holds the pair (f_{offset+i}, x_{offset+i+1}); offset is the first
    target position whose feature was observed (> 0 after a prefix-cache hit, whose
    positions the target never computed).
    """

    request_id: str
    offset: int
    features: torch.Tensor  # [capacity, h]; row i = f_{offset+i}
    num_features: int = 0
    # Pairs whose K/V sit in the head's cache. Draft steps write K/V beyond this
    # count; they are never counted, so the next catch-up simply overwrites them.
    num_computed_tokens: int = 0
    # The head's input tokens (x_{offset+1}, ...).
    all_token_ids: list[int] = field(default_factory=list)
    # The request's tokens when this state was last brought up to date: every cached
    # pair and feature depends only on a prefix of them.
    known_token_ids: list[int] = field(default_factory=list)

    def append_features(self, hidden: torch.Tensor) -> None:
        end = self.num_features + hidden.shape[0]
        if end > self.features.shape[0]:
            grown = self.features.new_empty(max(end, 2 * self.features.shape[0]),
                                            self.features.shape[1])
            grown[:self.num_features] = self.features[:self.num_features]
            self.features = grown
        self.features[self.num_features:end] = hidden
        self.num_features = end

    def keep_prefix(self, num_tokens: int) -> None:
        """Forget everything that depends on request tokens at positions >= num_tokens."""
        # f_p depends on x_0..x_p; the pair at position t also on x_{t+1}.
        self.num_features = max(0, min(self.num_features, num_tokens - self.offset))
        self.num_computed_tokens = max(0, min(self.num_computed_tokens,
                                              num_tokens - 1 - self.offset))


@dataclass
class _Draft:
    request: ProposalRequest
    sequence: _DraftSequence
    num_tokens: int
    num_pairs: int  # verified pairs: up to the request's last token
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class EagleProposer(Proposer):
    """Drafts with an EAGLE head over its own paged KV pool, batched across requests.

    Per step: a catch-up forward over the verified pairs (f_t, x_{t+1}) the head has
    not processed (at least the last one, whose output starts the draft), then
    num_tokens - 1 autoregressive steps that feed the head's predicted feature and
    drafted token back in. Rollback needs no bookkeeping in the normal case, since
    draft steps are never counted as computed; a request whose verified tokens or
    features changed underneath (detected against `known_token_ids` and the
    positions observe() reports) is cut back to what is still valid.
    """

    name = "eagle"
    needs_hidden_states = True

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, num_blocks: int,
                 block_size: int = 16, micro_batch: int | None = None, seed: int = 0) -> None:
        reference = next(head.parameters())
        self.head = head
        self.target = target
        self.device, self.dtype = reference.device, reference.dtype
        self.max_positions = head.rotary.max_positions
        # Most requests per head forward (None: the whole batch).
        self.micro_batch = micro_batch
        self.runner = ModelRunner(head, head.arch, num_blocks, block_size, self.device,
                                  self.dtype)
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.sampler = DraftSampler(seed)
        self._sequences: dict[str, _DraftSequence] = {}

    @classmethod
    def load(cls, head_dir: str | Path, target: LlamaForCausalLM, num_blocks: int,
             block_size: int = 16, micro_batch: int | None = None, seed: int = 0,
             select_linear: LinearSelector | None = None,
             target_arch: ArchConfig | None = None) -> EagleProposer:
        """The proposer for the head saved in head_dir (checked against, and placed
        like, the target; target_arch: its whole geometry, when the target is a
        tensor-parallel shard)."""
        return cls(load_eagle_head(head_dir, target, select_linear, target_arch), target,
                   num_blocks, block_size, micro_batch, seed)

    def check_integrity(self, idle: bool = False) -> None:
        self.kv_manager.check_integrity()
        if idle:
            assert self.kv_manager.num_free_blocks == self.kv_manager.num_blocks, \
                "the EAGLE head holds KV blocks with no request running"

    def memory_bytes(self) -> tuple[int, int]:
        return weight_bytes(self.head), self.runner.kv_cache_bytes()

    # ---- worker interface ----------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, request_id: str, first_position: int, hidden: torch.Tensor) -> None:
        # Tokens are checked when drafting starts (_start_draft), not on every step:
        # the target recomputes from any position whose token changed, and reports
        # it here as first_position, which is what cuts the features back.
        sequence = self._sequences.get(request_id)
        if sequence is not None:
            if sequence.offset <= first_position <= sequence.offset + sequence.num_features:
                # Features re-sent from first_position on replace what was there.
                sequence.keep_prefix(first_position)
            else:  # a gap, or a rewrite from before the first feature: start over
                self.release(request_id)
                sequence = None
        if sequence is None:
            empty = torch.empty(0, hidden.shape[-1], device=self.device, dtype=self.dtype)
            sequence = _DraftSequence(request_id, first_position, empty)
            self._sequences[request_id] = sequence
        sequence.append_features(hidden.detach().to(self.device, self.dtype))

    def release(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id, None)
        if sequence is not None:
            self.kv_manager.free(sequence)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        drafts = [self._start_draft(r) for r in requests]
        active = [d for d in drafts if d is not None]
        step = self.micro_batch or len(active) or 1
        for start in range(0, len(active), step):
            self._draft(active[start:start + step])
        proposals = []
        for draft in drafts:
            if draft is None:
                proposals.append(Proposal([]))
                continue
            draft.sequence.num_computed_tokens = draft.num_pairs
            probs = torch.stack(draft.probs) if draft.probs else None
            proposals.append(Proposal(draft.token_ids, probs))
        return proposals

    # ---- steps -----------------------------------------------------------------------------
    def _draft(self, active: list[_Draft]) -> None:
        """Catch-up forward, then one forward per further draft token, batched."""
        active, predicted = self._catch_up(active)
        self._choose(active, predicted)
        for step in range(1, max(d.num_tokens for d in active)):
            keep = [row for row, d in enumerate(active) if d.num_tokens > step]
            active, predicted = self._draft_step([active[row] for row in keep],
                                                 predicted[keep], step)
            self._choose(active, predicted)

    def _start_draft(self, request: ProposalRequest) -> _Draft | None:
        """Bring the request's state up to date and reserve KV; None: no proposal."""
        sequence = self._sequences.get(request.request_id)
        if sequence is None:
            return None
        token_ids = request.token_ids
        self._forget_changed_tokens(sequence, token_ids)
        num_pairs = len(token_ids) - 1 - sequence.offset
        if num_pairs - sequence.num_computed_tokens > MAX_CATCH_UP:
            # A long backlog (a new prompt, or steps without speculation): the head
            # restarts on the latest MAX_CATCH_UP positions instead of running them all.
            sequence = self._rebase(sequence, num_pairs - MAX_CATCH_UP)
            num_pairs = len(token_ids) - 1 - sequence.offset
        # The last draft pair sits at target position len + num_tokens - 2.
        num_tokens = min(request.num_tokens, self.max_positions - len(token_ids) + 1)
        if num_pairs < 1 or sequence.num_features < num_pairs or num_tokens < 1:
            return None  # the latest verified position's feature has not been observed
        # Recompute at least the last pair: its output is where drafting starts.
        sequence.num_computed_tokens = min(sequence.num_computed_tokens, num_pairs - 1)
        new_pairs = num_pairs - sequence.num_computed_tokens
        if not self.kv_manager.allocate_slots(sequence, new_pairs + num_tokens - 1):
            return None
        sequence.all_token_ids = token_ids[sequence.offset + 1:]
        sequence.known_token_ids = list(token_ids)
        return _Draft(request, sequence, num_tokens, num_pairs)

    def _rebase(self, sequence: _DraftSequence, drop: int) -> _DraftSequence:
        """The request's state without its first `drop` positions: their features go,
        the head's cache is freed, and the rest is recomputed at the next catch-up."""
        self.kv_manager.free(sequence)
        kept = sequence.features[drop:sequence.num_features].clone()
        rebased = _DraftSequence(sequence.request_id, sequence.offset + drop, kept)
        rebased.num_features = kept.shape[0]
        rebased.known_token_ids = sequence.known_token_ids
        self._sequences[sequence.request_id] = rebased
        return rebased

    def _forget_changed_tokens(self, sequence: _DraftSequence, token_ids: list[int]) -> None:
        known = sequence.known_token_ids
        if len(known) <= len(token_ids) and token_ids[:len(known)] == known:
            return  # the usual case: tokens were only appended
        common = 0
        for old, new in zip(known, token_ids, strict=False):
            if old != new:
                break
            common += 1
        sequence.keep_prefix(common)
        sequence.known_token_ids = known[:common]

    def _forward(self, drafts: list[_Draft], starts: list[int], tokens: list[list[int]],
                 features: list[torch.Tensor]) -> tuple[list[_Draft], list[int], torch.Tensor]:
        """One head forward over the pairs (features[i], tokens[i]) of drafts[i], at head
        positions starts[i] onwards. Returns the drafts, their pair counts and the
        predicted features in the batch's order (decode-shaped rows first)."""
        rows = [ScheduledRequest(d.sequence.request_id, ids, start,
                                 self.kv_manager.get_block_table(d.sequence.request_id))
                for d, start, ids in zip(drafts, starts, tokens, strict=True)]
        batch = self.runner.prepare(rows)
        drafts = [drafts[i] for i in batch.order]
        num_new = [len(tokens[i]) for i in batch.order]
        offsets = torch.tensor([d.sequence.offset for d in drafts], device=self.device)
        positions = batch.positions + offsets.repeat_interleave(
            torch.tensor(num_new, device=self.device))
        inputs = torch.cat([features[i] for i in batch.order])
        hidden = self.head(inputs, self.target.embed(batch.token_ids), positions,
                           batch.attention)
        return drafts, num_new, hidden

    def _catch_up(self, drafts: list[_Draft]) -> tuple[list[_Draft], torch.Tensor]:
        """Run the verified pairs the head has not processed; returns the drafts in
        batch order and each one's last predicted feature (the first draft's input)."""
        starts = [d.sequence.num_computed_tokens for d in drafts]
        tokens = [d.sequence.all_token_ids[start:d.num_pairs]
                  for d, start in zip(drafts, starts, strict=True)]
        features = [d.sequence.features[start:d.num_pairs]
                    for d, start in zip(drafts, starts, strict=True)]
        drafts, num_new, hidden = self._forward(drafts, starts, tokens, features)
        for draft in drafts:
            draft.sequence.num_computed_tokens = draft.num_pairs
        last_rows = torch.tensor(num_new, device=self.device).cumsum(0) - 1
        return drafts, hidden[last_rows]

    def _draft_step(self, drafts: list[_Draft], predicted: torch.Tensor, step: int
                    ) -> tuple[list[_Draft], torch.Tensor]:
        """Feed each request's (f_hat, latest draft token) back in: one pair each."""
        starts = [draft.num_pairs + step - 1 for draft in drafts]
        tokens = [[draft.token_ids[-1]] for draft in drafts]
        drafts, _, hidden = self._forward(drafts, starts, tokens, list(predicted.split(1)))
        return drafts, hidden

    def _choose(self, drafts: list[_Draft], predicted: torch.Tensor) -> None:
        """Append each request's next draft token: argmax for greedy requests, a draw
        from its processed distribution q (kept for verification) otherwise."""
        logits = self.target.compute_logits(predicted)
        chosen = greedy(logits).tolist()
        sampled_rows = [row for row, d in enumerate(drafts)
                        if d.request.params.temperature != 0]
        if sampled_rows:
            params = [drafts[row].request.params for row in sampled_rows]
            q = processed_probs(logits[sampled_rows], params)
            for row, q_row in zip(sampled_rows, q, strict=True):
                drafts[row].probs.append(q_row)
                draft = drafts[row]
                position = len(draft.request.token_ids) + len(draft.token_ids)
                chosen[row] = self.sampler.draw(q_row, draft.request, position)
        for draft, token in zip(drafts, chosen, strict=True):
            draft.token_ids.append(token)


def proposer_footprint(context: ProposerContext) -> ProposerFootprint:
    """The head: an FC (2h -> h, with bias) and one decoder layer; it shares the
    target's embedding and LM head."""
    arch = read_head_config(context.model_dir, context.target_arch)[0]
    hidden = arch.hidden_size
    return ProposerFootprint(arch, 2 * hidden * hidden + hidden + arch.layer_parameters,
                             has_lm_head=False)


def build_proposer(context: ProposerContext) -> EagleProposer:
    spec = context.config.spec
    return EagleProposer.load(context.model_dir, context.target.model, context.num_blocks,
                              context.config.cache.block_size, spec.draft_micro_batch,
                              seed=context.config.model.seed,
                              select_linear=context.select_linear,
                              target_arch=context.target_arch)
