"""What crosses the executor boundary: plain, picklable data describing one step, one
round of speculative proposals, and their results.

The engine builds a `StepInput` from the scheduler's decision (`build_step`); a worker,
in this process or another, runs it and answers with a `StepOutput`. Nothing here holds
an engine object, a tensor or a reference the worker could follow back into the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.outputs import TokenLogprob
from tokenmill.reasoning import ThinkingTokens
from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingRequest:
    """How to choose a request's next token(s) this step."""

    params: SamplingParams
    # Which completion of an n > 1 request this is (seeded streams differ by it).
    sample_index: int
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    # The request's tokens so far, only when a logits processor reads them
    # (params.reads_history: the penalties, the thinking budget).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # A reasoning model's markers in token ids, when the request controls its thinking.
    thinking: ThinkingTokens | None = None


@dataclass
class PromptLogprobsRequest:
    """Logprobs of target_token_ids[i] under the logits at position first_position + i."""

    first_position: int
    target_token_ids: list[int]
    num_top: int


@dataclass
class ScheduledRequest:
    """One request's part of a step: the tokens to compute on top of its cache."""

    request_id: str
    # Tokens computed this step, at positions num_computed_tokens onwards: real tokens,
    # then num_spec_tokens speculative ones to verify.
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    num_spec_tokens: int = 0
    # Set when the step reaches the request's last real token: sample a token there, or
    # verify the speculative tokens after it.
    sampling: SamplingRequest | None = None
    prompt_logprobs: PromptLogprobsRequest | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One real token (plus drafts) on a cached context: the batched decode path."""
        return self.num_computed_tokens > 0 and self.num_new_tokens == 1 + self.num_spec_tokens


@dataclass
class StepInput:
    requests: list[ScheduledRequest]
    # Preempted this step: a proposer drops what it keeps for them (their sampling
    # state stays: a seeded request resumes its stream).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Hand the target's hidden states to a feature-level proposer (EAGLE).
    keep_hidden_states: bool = False
    # Re-plan replicated experts before this step (every rank on the same step).
    rebalance_experts: bool = False


@dataclass
class RequestStepOutput:
    # Emitted tokens: the sampled one, or the accepted drafts then the target's own.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class StepOutput:
    outputs: dict[str, RequestStepOutput] = field(default_factory=dict)
    # Requests the step could not be run for (request id -> what went wrong); set by
    # the engine when it retries a failed step request by request.
    failed: dict[str, str] = field(default_factory=dict)
    # Seconds the worker spent in each phase of the step (prepare_inputs, forward,
    # sample) and, of the forward, in collectives (communication): what a profiler
    # shows when the worker runs in another process. Timing, not a result: two runs of
    # one step compare equal without it.
    phase_seconds: dict[str, float] = field(default_factory=dict, compare=False)
    # Tokens each MoE layer routed to each of its experts in this step ([] for a dense
    # model): statistics, not a result.
    expert_load: list[list[int]] = field(default_factory=list, compare=False)
    # With replicated experts: (token, expert) pairs each rank computed, per layer.
    rank_load: list[list[int]] = field(default_factory=list, compare=False)
    # Expert copies whose weights moved between ranks before this step (re-planning).
    expert_moves: int = field(default=0, compare=False)
    # Sparse attention, per (layer, head kind): (keys attended, (decode query, KV head)
    # pairs) this step.
    sparse_attention: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict,
                                                                     compare=False)

    def output(self, request_id: str) -> RequestStepOutput:
        """The request's entry, created on first use."""
        entry = self.outputs.get(request_id)
        if entry is None:
            entry = self.outputs[request_id] = RequestStepOutput()
        return entry


@dataclass
class ProposalRequest:
    """A running request a proposer should draft up to num_tokens tokens for."""

    request_id: str
    token_ids: list[int]  # prompt + output so far
    params: SamplingParams
    sample_index: int
    num_tokens: int


def build_step(sched: SchedulerOutput, kv_manager: KVCacheManager,
               keep_hidden_states: bool = False) -> StepInput:
    """The plain description of what the scheduler granted."""
    requests = [_scheduled_request(request, num_new, kv_manager)
                for request, num_new in sched.scheduled]
    return StepInput(requests, [r.request_id for r in sched.preempted], keep_hidden_states)


def _scheduled_request(request: Request, num_new: int, kv_manager: KVCacheManager
                       ) -> ScheduledRequest:
    start = request.num_computed_tokens
    real_end = min(start + num_new, request.num_tokens)
    token_ids = request.all_token_ids[start:real_end]
    num_spec = start + num_new - real_end
    if num_spec:  # the speculative tokens follow the real ones
        token_ids = token_ids + request.spec_token_ids[:num_spec]
    scheduled = ScheduledRequest(request.request_id, token_ids, start,
                                 kv_manager.get_block_table(request.request_id), num_spec)
    if real_end == request.num_tokens:
        params = request.sampling_params
        history = params.reads_history
        scheduled.sampling = SamplingRequest(
            params, request.sample_index, request.num_output_tokens, request.eos_token_ids,
            request.prompt_token_ids if history else None,
            request.output_token_ids if history else None,
            request.thinking if params.controls_thinking else None)
    if request.prompt_logprobs is not None:
        scheduled.prompt_logprobs = _prompt_logprobs_request(request, num_new)
    return scheduled


def _prompt_logprobs_request(request: Request, num_new: int) -> PromptLogprobsRequest | None:
    """The prompt tokens this chunk's positions predict that were not reported yet."""
    start = request.num_computed_tokens
    # Position p predicts token p + 1.
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(start + num_new, request.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptLogprobsRequest(first, request.prompt_token_ids[first + 1:last + 1],
                                 request.sampling_params.prompt_logprobs)
