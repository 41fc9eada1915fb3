"""Token-budget scheduler: which requests run this step, and how many tokens each.

Pure Python (no torch). Each step spends at most `max_num_batched_tokens` tokens:
running decodes first, then partial prefills, then admissions from the waiting
queue (reversed into prefills-first when the waiting queue starves). When the
block pool runs out, the latest-arrived running request is preempted and later
recomputed from scratch.

Fairness, per request:
- a waiting request that does not fit may be skipped so that smaller ones behind it
  run, but once `fair_admission_passes` later requests have been admitted ahead of
  it, nothing behind it is admitted until it runs (the pool drains for it: it fits
  alone, checked when it was added);
- a request preempted `max_preemptions_per_request` times is readmitted only when the
  pool holds the rest of its tokens and everything the running requests still need;
  while it runs every admission keeps that promise (reserves what the newcomer and
  the running requests need to finish), and it is never chosen as a victim again. So
  no request is preempted more than max_preemptions_per_request times;
- in prefills-first mode admissions leave a free block per running decode, so the
  prefills that overtook the decodes do not preempt them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, num_new_tokens) in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # True when the waiting queue starved and prefills went first.
    prefill_first: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        # In admission order.
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish_request(self, request: Request, reason: str) -> None:
        """Mark finished and return its blocks; safe to call in any state."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.free(request)
        self.kv.forget(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        granted: dict[Request, int] = {}
        self._budget = self.config.max_num_batched_tokens
        out.prefill_first = self._prefills_starving()
        decodes = [r for r in self.running if r.num_tokens_to_compute == 1]
        partials = [r for r in self.running if r.num_tokens_to_compute > 1]
        if out.prefill_first:
            # Prefills jump the queue only with blocks that are free: letting them
            # preempt here could evict the decodes they just overtook, forever. Those
            # left out get a normal turn (which may preempt) after the decodes.
            keep_free = len(decodes)  # a decode needs at most one new block per step
            self._schedule_running(partials, granted, out, may_preempt=False, reserve=keep_free)
            self._admit(granted, reserve=keep_free)
            self._schedule_running(decodes, granted, out)
            self._schedule_running([r for r in partials if r not in granted], granted, out)
        else:
            self._schedule_running(decodes, granted, out)
            self._schedule_running(partials, granted, out)
            self._admit(granted)
        now = self.clock()
        for request, num_new in granted.items():
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            out.scheduled.append((request, num_new))
        out.num_batched_tokens = sum(granted.values())
        return out

    def _prefills_starving(self) -> bool:
        if not self.waiting:
            return False
        if len(self.waiting) > self.config.starvation_queue_threshold:
            return True
        oldest = min(r.metrics.arrival_time for r in self.waiting)
        return self.clock() - oldest > self.config.starvation_wait_s

    def _num_new_tokens(self, request: Request, num_computed: int) -> int:
        """Tokens to grant this step under the chunking policy and the remaining budget."""
        cfg = self.config
        remaining = request.num_tokens - num_computed
        if remaining <= 1:
            return min(remaining, self._budget)
        if not cfg.enable_chunked_prefill:
            return self._whole(remaining)
        if cfg.chunk_policy == "fixed":
            return min(remaining, cfg.prefill_chunk_size, self._budget)
        # dynamic: short prompts run whole, long ones in at most dynamic_max_chunks chunks.
        if request.num_tokens <= cfg.dynamic_chunk_threshold:
            return self._whole(remaining)
        chunk = -(-request.num_tokens // cfg.dynamic_max_chunks)
        return min(remaining, chunk, self._budget)

    def _whole(self, remaining: int) -> int:
        """All remaining tokens, or none this step; a prompt larger than a whole step's
        budget could never run whole, so it is chunked rather than left waiting forever."""
        if remaining <= self._budget:
            return remaining
        return self._budget if remaining > self.config.max_num_batched_tokens else 0

    def _schedule_running(self, requests: list[Request], granted: dict[Request, int],
                          out: SchedulerOutput, may_preempt: bool = True, reserve: int = 0
                          ) -> None:
        for request in requests:
            if request.status != RequestStatus.RUNNING or self._budget <= 0:
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens)
            if num_new == 0:
                continue
            if num_new == 1 and request.spec_token_ids:
                num_new = self._lookahead(request)
            while not self.kv.allocate_slots(request, num_new, reserve=reserve):
                victim = self._preemption_victim() if may_preempt else None
                if victim is None:
                    break  # nobody may yield a block: this request waits a step
                self._preempt(victim, granted, out)
                if victim is request:
                    break
            else:
                granted[request] = num_new
                self._budget -= num_new

    def _lookahead(self, request: Request) -> int:
        """Tokens for a decode with speculative tokens: 1 + as many of them as fit the
        budget and the free blocks (lookahead slots); the rest are dropped."""
        num_new = min(1 + len(request.spec_token_ids), self._budget)
        if num_new > 1 and not self.kv.allocate_slots(request, num_new):
            num_new = 1
        keep = num_new - 1
        if keep < len(request.spec_token_ids):
            request.spec_token_ids = request.spec_token_ids[:keep]
        return num_new

    def _pinned(self, request: Request) -> bool:
        """Preempted as often as allowed: readmitted with room to finish, never again a
        victim."""
        return request.metrics.num_preemptions >= self.config.max_preemptions_per_request

    def _preemption_victim(self) -> Request | None:
        """The latest arrival that is neither pinned nor the earliest arrival (which
        always progresses and fits the pool alone: no livelock); None when there is
        none (then the requests that run have room to finish: see _completion_reserve)."""
        earliest = min(self.running, key=lambda r: r.metrics.arrival_time)
        if len(self.running) == 1:
            return None if self._pinned(earliest) else earliest
        candidates = [r for r in self.running if r is not earliest and not self._pinned(r)]
        return max(reversed(candidates), key=lambda r: r.metrics.arrival_time, default=None)

    def _preempt(self, victim: Request, granted: dict[Request, int], out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self._budget += granted.pop(victim, 0)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        logger.warning("preempted request %s (recompute of %d tokens); total preemptions %d",
                       victim.request_id, victim.num_tokens, self.num_preemptions)

    def _admit(self, granted: dict[Request, int], reserve: int = 0) -> None:
        """Admit waiting requests in order while budget, blocks (beyond `reserve`) and
        max_num_seqs allow."""
        skipped: list[Request] = []
        index = 0
        while (index < len(self.waiting) and self._budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[index]
            if request.waits_for_prefix:
                index += 1
                continue
            cached = self.kv.find_cached_blocks(request) if request.uses_prefix_cache else []
            num_computed = len(cached) * self.kv.block_size
            num_new = self._num_new_tokens(request, num_computed)
            keep_free = reserve + self._completion_reserve(request, num_computed + num_new)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, cached, keep_free):
                # Does not fit now: let smaller requests behind it in, a bounded number
                # of times per step, and only until it has been passed over enough.
                if request.passed_over >= self.config.fair_admission_passes:
                    break
                skipped.append(request)
                if len(skipped) > self.config.max_admission_skips:
                    break
                index += 1
                continue
            for earlier in skipped:
                earlier.passed_over += 1
            request.passed_over = 0
            del self.waiting[index]
            request.num_computed_tokens = num_computed
            request.metrics.num_cached_tokens = max(request.metrics.num_cached_tokens, num_computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            granted[request] = num_new
            self._budget -= num_new

    def _completion_reserve(self, request: Request, first_chunk_end: int) -> int:
        """Blocks to keep free when admitting `request`: none, unless it is pinned or a
        pinned request runs; then the pool must also hold the rest of the newcomer's
        tokens and everything the running requests still need to finish. That keeps
        the invariant "free blocks cover every running request's remaining need" for
        as long as a pinned request runs, so none of them needs a victim."""
        if not (self._pinned(request) or any(self._pinned(r) for r in self.running)):
            return 0
        kv = self.kv
        own = (kv.blocks_needed(request.num_prompt_tokens + request.max_tokens)
               - kv.blocks_needed(first_chunk_end))
        running = sum(kv.blocks_needed(r.num_prompt_tokens + r.max_tokens)
                      - len(kv.get_block_table(r.request_id)) for r in self.running)
        return max(own, 0) + max(running, 0)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, request
            table = self.kv.get_block_table(request.request_id)
            assert len(table) >= self.kv.blocks_needed(request.num_computed_tokens), request
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
            assert not self.kv.get_block_table(request.request_id), request
