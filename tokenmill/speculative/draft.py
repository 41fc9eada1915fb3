"""Draft-model proposals: a small model with the target's tokenizer guesses ahead.

The draft keeps its own paged KV pool (its own KVCacheManager and ModelRunner in the
worker) and a shadow sequence per target request holding the tokens the draft has
processed (at most the latest MAX_CATCH_UP tokens when it starts, or restarts after
a long gap). Before proposing it compares the shadow with the target's tokens:
everything after the common prefix (rejected drafts) is dropped by moving the
shadow's num_computed_tokens back, exactly like the target's own rollback. Then one
forward catches the draft up on the target's new tokens and k - 1 more decode
forwards extend the guess, batched across requests in micro-batches of at most
draft_micro_batch requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.step import ProposalRequest, ScheduledRequest
from tokenmill.layers.linear import weight_bytes
from tokenmill.layers.rejection_sampler import processed_probs
from tokenmill.layers.sampler import greedy
from tokenmill.model.loader import LoadedModel, dtype_name, load_model, read_config
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.speculative.base import MAX_CATCH_UP, DraftSampler, Proposal, Proposer
from tokenmill.speculative.factory import ProposerContext, ProposerFootprint

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DraftShadow:
    """The draft's view of one request: its tokens from `offset` on."""

    request_id: str
    offset: int
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    # This step's request (sampling parameters, seed) and what was drafted for it.
    request: ProposalRequest | None = None
    drafted: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, draft: LoadedModel, target_vocab_size: int, num_blocks: int,
                 block_size: int, micro_batch: int | None = None, seed: int = 0) -> None:
        if draft.arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_model: the draft's vocabulary ({draft.arch.vocab_size}) differs "
                f"from the target's ({target_vocab_size}); a draft must share the tokenizer")
        self.max_len = draft.arch.max_position_embeddings
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(draft.model, draft.arch, num_blocks, block_size,
                                  draft.device, draft.dtype)
        self.micro_batch = micro_batch
        self.sampler = DraftSampler(seed)
        self.shadows: dict[str, DraftShadow] = {}

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.kv_manager.free(shadow)

    def check_integrity(self, idle: bool = False) -> None:
        self.kv_manager.check_integrity()
        if idle:
            assert self.kv_manager.num_free_blocks == self.kv_manager.num_blocks, \
                "the draft model holds KV blocks with no request running"

    def memory_bytes(self) -> tuple[int, int]:
        return weight_bytes(self.runner.model), self.runner.kv_cache_bytes()

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        work = []
        for request in requests:
            shadow = self._sync(request)
            shadow.request, shadow.drafted, shadow.q_rows = request, [], []
            if shadow.num_tokens + request.num_tokens <= self.max_len:
                work.append(shadow)
        step = self.micro_batch or len(work) or 1
        for start in range(0, len(work), step):
            self._propose_batch(work[start:start + step])
        proposals = []
        for request in requests:
            shadow = self.shadows[request.request_id]
            probs = torch.stack(shadow.q_rows) if shadow.q_rows else None
            proposals.append(Proposal(shadow.drafted, probs))
            shadow.request, shadow.drafted, shadow.q_rows = None, [], []
        return proposals

    def _sync(self, request: ProposalRequest) -> DraftShadow:
        """The request's shadow, rolled back to the tokens it shares with the target.

        A shadow covers the request's tokens from `offset` on: after a backlog of
        more than MAX_CATCH_UP tokens (a new prompt, or steps without speculation) it
        restarts on the latest ones, so catching up costs a bounded forward. Rotary
        positions only encode distances, so the restarted shadow attends exactly as a
        sliding window would; the draft sees less context, the output is unchanged.
        """
        rid = request.request_id
        shadow = self.shadows.get(rid)
        tokens = request.token_ids
        if shadow is not None:
            new = tokens[shadow.offset:]
            old = shadow.all_token_ids
            # At least the last token is recomputed: its output starts the draft (the
            # target may not have moved since the last proposal, e.g. when the step
            # had no room for this request).
            common = min(shadow.num_computed_tokens, len(new) - 1)
            # Only the tail can differ (rejected drafts): scan back from the end.
            while common and old[common - 1] != new[common - 1]:
                common -= 1
            if len(new) - common > MAX_CATCH_UP:
                self.kv_manager.free(shadow)
                shadow = None
        if shadow is None:
            offset = max(0, len(tokens) - MAX_CATCH_UP)
            new, common = tokens[offset:], 0
            shadow = self.shadows[rid] = DraftShadow(rid, offset, list(new))
        shadow.num_computed_tokens = common
        shadow.all_token_ids = list(new)
        return shadow

    def _propose_batch(self, work: list[DraftShadow]) -> None:
        active = list(work)
        while active:
            # Catch-up (first round) or one decode token per shadow.
            scheduled = []
            for shadow in active:
                start, end = shadow.num_computed_tokens, shadow.num_tokens
                if self.kv_manager.allocate_slots(shadow, end - start):
                    scheduled.append(ScheduledRequest(
                        shadow.request_id, shadow.all_token_ids[start:end], start,
                        self.kv_manager.get_block_table(shadow.request_id)))
            if not scheduled:
                break
            shadows = {s.request_id: s for s in active}
            batch = self.runner.prepare(scheduled)
            hidden = self.runner.forward(batch)
            ordered = [shadows[scheduled[i].request_id] for i in batch.order]
            for shadow in ordered:
                shadow.num_computed_tokens = shadow.num_tokens
            last_rows = [end - 1 for end in batch.query_start[1:]]
            logits = self.runner.model.compute_logits(hidden[last_rows])
            tokens, probs = self._draw(logits, ordered)
            active = []
            for row, shadow in enumerate(ordered):
                shadow.drafted.append(tokens[row])
                if probs is not None:
                    shadow.q_rows.append(probs[row])
                shadow.all_token_ids.append(tokens[row])
                if len(shadow.drafted) < shadow.request.num_tokens:
                    active.append(shadow)

    def _draw(self, logits: torch.Tensor, shadows: list[DraftShadow]
              ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy rows take the argmax; sampled rows draw from their processed q."""
        params = [s.request.params for s in shadows]
        tokens = greedy(logits).tolist()
        if all(p.temperature == 0 for p in params):
            return tokens, None
        probs = processed_probs(logits, params)
        for row, (shadow, p) in enumerate(zip(shadows, params, strict=True)):
            if p.temperature > 0:
                # The drafted token's position in the request's sequence.
                position = len(shadow.request.token_ids) + len(shadow.drafted)
                tokens[row] = self.sampler.draw(probs[row], shadow.request, position)
        return tokens, probs



def proposer_footprint(context: ProposerContext) -> ProposerFootprint:
    arch = read_config(context.model_dir)
    return ProposerFootprint(arch, arch.num_parameters, has_lm_head=arch.tie_word_embeddings)


def build_proposer(context: ProposerContext) -> DraftModelProposer:
    spec = context.config.spec
    draft = load_model(context.model_dir, dtype_name(context.dtype), context.device.type,
                       progress=context.progress, select_linear=context.select_linear)
    return DraftModelProposer(draft, context.target_arch.vocab_size, context.num_blocks,
                              context.config.cache.block_size, spec.draft_micro_batch,
                              seed=context.config.model.seed)
