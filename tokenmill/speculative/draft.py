"""Draft-model proposals: a small model with the target's tokenizer guesses ahead.

The draft keeps its own paged KV pool (its own KVCacheManager and ModelRunner in the
same process) and a shadow Request per target request holding the tokens the draft
has processed (at most the latest MAX_CATCH_UP tokens when it starts, or restarts
after a long gap). Before proposing it compares the shadow with the target's
tokens: everything after the common prefix (rejected drafts) is dropped by moving
the shadow's num_computed_tokens back, exactly like the target's own rollback. Then
one forward catches the draft up on the target's new tokens and k - 1 more decode
forwards extend the guess, batched across requests in micro-batches of at most
draft_micro_batch requests.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.layers.linear import LinearSelector
from tokenmill.model.loader import load_model
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.speculative.base import MAX_CATCH_UP, DraftSampler, Proposal, Proposer
from tokenmill.speculative.verify import processed_probs

logger = logging.getLogger(__name__)


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model_dir: str, target_vocab_size: int, device: torch.device,
                 dtype: torch.dtype, num_blocks: int, block_size: int,
                 micro_batch: int | None = None, seed: int = 0, progress: bool = False,
                 select_linear: LinearSelector | None = None) -> None:
        loaded = load_model(model_dir, _dtype_name(dtype), device.type, progress=progress,
                            select_linear=select_linear)
        if loaded.arch.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_model: the draft's vocabulary ({loaded.arch.vocab_size}) differs "
                f"from the target's ({target_vocab_size}); a draft must share the tokenizer")
        self.max_len = loaded.arch.max_position_embeddings
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(loaded.model, loaded.arch, num_blocks, block_size,
                                  loaded.device, loaded.dtype, seed=seed)
        self.micro_batch = micro_batch
        self.sampler = DraftSampler(seed)
        self.shadows: dict[str, Request] = {}
        self.offsets: dict[str, int] = {}  # the first request position a shadow holds

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        self.offsets.pop(request_id, None)
        if shadow is not None:
            self.kv_manager.free(shadow)
        self.sampler.release(request_id)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        proposals = {r.request_id: Proposal([]) for r in requests}
        work = []
        for request, k in zip(requests, num_tokens, strict=True):
            shadow = self._sync(request)
            if shadow.num_tokens + k <= self.max_len:
                work.append((shadow, k))
        step = self.micro_batch or len(work) or 1
        for start in range(0, len(work), step):
            self._propose_batch(work[start:start + step], proposals)
        return [proposals[r.request_id] for r in requests]

    def _sync(self, request: Request) -> Request:
        """The request's shadow, rolled back to the tokens it shares with the target.

        A shadow covers the request's tokens from `offset` on: after a backlog of
        more than MAX_CATCH_UP tokens (a new prompt, or steps without speculation) it
        restarts on the latest ones, so catching up costs a bounded forward. Rotary
        positions only encode distances, so the restarted shadow attends exactly as a
        sliding window would; the draft sees less context, the output is unchanged.
        """
        rid = request.request_id
        shadow = self.shadows.get(rid)
        tokens = request.all_token_ids
        if shadow is not None:
            new = tokens[self.offsets[rid]:]
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
            shadow = Request(rid, new, request.sampling_params, 0.0, request.max_tokens)
            self.shadows[rid], self.offsets[rid] = shadow, offset
        shadow.num_computed_tokens = common
        shadow.all_token_ids = list(new)
        return shadow

    def _propose_batch(self, work: list[tuple[Request, int]],
                       proposals: dict[str, Proposal]) -> None:
        active = list(work)
        drafted: dict[str, list[int]] = {s.request_id: [] for s, _ in work}
        q_rows: dict[str, list[torch.Tensor]] = {s.request_id: [] for s, _ in work}
        while active:
            # Catch-up (first round) or one decode token per shadow.
            scheduled = []
            for shadow, _ in active:
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv_manager.allocate_slots(shadow, num_new):
                    scheduled.append((shadow, num_new))
            if not scheduled:
                break
            tables = {s.request_id: self.kv_manager.get_block_table(s.request_id) for s, _ in scheduled}
            ordered, ids, positions, metadata = self.runner.prepare(scheduled, tables)
            hidden = self.runner.model(ids, positions, self.runner.kv_caches, metadata,
                                       self.runner.backend)
            rows, offset = [], 0
            for shadow, num_new in ordered:
                offset += num_new
                rows.append(offset - 1)
                shadow.num_computed_tokens += num_new
            logits = self.runner.model.compute_logits(hidden[rows])
            tokens, probs = self._draw(logits, [s for s, _ in ordered])
            budget = dict(active)
            active = []
            for row, (shadow, _) in enumerate(ordered):
                rid = shadow.request_id
                drafted[rid].append(tokens[row])
                if probs is not None:
                    q_rows[rid].append(probs[row])
                shadow.all_token_ids.append(tokens[row])
                if len(drafted[rid]) < budget[shadow]:
                    active.append((shadow, budget[shadow]))
        for shadow, _ in work:
            rid = shadow.request_id
            rows = q_rows[rid]
            proposals[rid] = Proposal(drafted[rid], torch.stack(rows) if rows else None)

    def _draw(self, logits: torch.Tensor, shadows: list[Request]
              ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy rows take the argmax; sampled rows draw from their processed q."""
        params = [s.sampling_params for s in shadows]
        tokens = logits.argmax(dim=-1).tolist()
        if all(p.temperature == 0 for p in params):
            return tokens, None
        probs = processed_probs(logits, params)
        for row, (shadow, p) in enumerate(zip(shadows, params, strict=True)):
            if p.temperature > 0:
                tokens[row] = self.sampler.draw(probs[row], shadow)
        return tokens, probs


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}[dtype]
