"""Speculative decoding as the engine sees it: hooks around a step.

    before_schedule(running)        propose: the controller picks k per request, the
                                    worker's proposer drafts, request.spec_token_ids
    after_execute(step, output, s)  acceptance: statistics, the controller's estimates
                                    and cost fits; the drafts are consumed
    after_step(seconds, emitted)    the guard: whole-step throughput with and without

Rollback needs nothing here: the engine advances a request's num_computed_tokens by
the tokens the worker emitted (1 + accepted), so rejected drafts' K/V is simply
overwritten later. Engine-side only: no torch, and the proposer itself lives in the
worker, reached through `propose` (the executor's).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenmill.config import SpecConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.core.stats import EngineStats
from tokenmill.core.step import ProposalRequest, StepInput, StepOutput
from tokenmill.speculative.controller import SpecController

Propose = Callable[[list[ProposalRequest]], list[list[int]]]


class SpeculativeDriver:
    def __init__(self, config: SpecConfig, propose: Propose, max_model_len: int,
                 stats: EngineStats, padded_rows: Callable[[int], int]) -> None:
        self.controller = SpecController(config, padded_rows)
        self._propose = propose
        self.max_model_len = max_model_len
        self.stats = stats
        # Whether the step under way is decode-only: the steps the controller's fits and
        # guard compare (prefill chunks would skew them).
        self._decode_only = False
        self.tracer = None

    # ---- before scheduling --------------------------------------------------------------
    def before_schedule(self, running: list[Request]) -> None:
        """Draft tokens for running decodes that may speculate, k chosen per request."""
        candidates, limits = [], []
        for request in running:
            request.spec_token_ids = []
            if request.num_tokens_to_compute != 1:
                continue
            # Room left: drafts never run past max_tokens or the context.
            limit = min(request.max_tokens - request.num_output_tokens - 1,
                        self.max_model_len - request.num_tokens)
            if limit > 0:
                candidates.append(request)
                limits.append(limit)
        if not candidates:
            return
        plan = self.controller.plan(candidates, limits)
        chosen = [(r, k) for r, k in zip(candidates, plan, strict=True) if k > 0]
        if not chosen:
            return
        started = time.perf_counter()
        drafts = self._propose([
            ProposalRequest(r.request_id, r.all_token_ids, r.sampling_params, r.sample_index, k)
            for r, k in chosen])
        drafted = 0
        for (request, k), tokens in zip(chosen, drafts, strict=True):
            request.spec_token_ids = tokens[:k]
            drafted += len(request.spec_token_ids)
        self.controller.record_propose(drafted, time.perf_counter() - started)
        if self.tracer is not None:
            self.tracer.mark("propose")

    def keep_hidden_states(self, sched: SchedulerOutput, needs_hidden_states: bool) -> bool:
        """Whether this step hands the target's hidden states to the proposer (see
        SpecController.wants_features); also notes whether the step is decode-only."""
        self._decode_only = all(r.num_computed_tokens == r.num_tokens - 1 > 0
                                for r, _ in sched.scheduled)
        return needs_hidden_states and self.controller.wants_features(len(sched.scheduled))

    # ---- after the step -----------------------------------------------------------------
    def after_execute(self, sched: SchedulerOutput, step: StepInput, output: StepOutput,
                      forward_seconds: float) -> None:
        """Account the verifications; the requests' drafts are consumed."""
        if self._decode_only:
            self.controller.record_forward(sum(r.num_new_tokens for r in step.requests),
                                           forward_seconds)
        for (request, _), scheduled in zip(sched.scheduled, step.requests, strict=True):
            num_drafted = scheduled.num_spec_tokens
            if not num_drafted:
                continue
            num_accepted = len(output.outputs[request.request_id].token_ids) - 1
            self.stats.record_verification(num_drafted, num_accepted)
            request.metrics.spec_draft_tokens += num_drafted
            request.metrics.spec_accepted_tokens += num_accepted
            self.controller.record_verify(request.request_id, num_drafted, num_accepted)
            request.spec_token_ids = []

    def after_step(self, seconds: float, num_emitted: int, speculated: bool,
                   batch: int) -> None:
        """A whole decode-only step (propose to last emitted token), for the guard."""
        if self._decode_only:
            self.controller.record_step(seconds, num_emitted, speculated, batch)

    def release(self, request: Request) -> None:
        request.spec_token_ids = []
        self.controller.release(request.request_id)
