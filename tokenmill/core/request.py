"""A request's state as the scheduler sees it: pure Python, no torch.

The whole scheduling design rests on one number per request: num_computed_tokens
(tokens whose KV is in the cache). A step grants num_new_tokens on top of it.
Prefill, chunked prefill, prefix-cache hits, decode and recompute after preemption
are all "compute the tokens from num_computed_tokens up to num_tokens".
"""

from __future__ import annotations

import enum

from tokenmill.outputs import RequestMetrics, TokenLogprob
from tokenmill.reasoning import ThinkingTokens
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        sample_index: int = 0,
        group_id: str | None = None,
        thinking: ThinkingTokens | None = None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.sample_index = sample_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        # A reasoning model's markers (None for a model that does not reason).
        self.thinking = thinking
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        # Why the engine failed it, when finish_reason is "error".
        self.error: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        # A sibling (same prompt, n > 1) whose prefill this request waits for so that
        # it can share the prompt's blocks through the prefix cache.
        self.prefix_source: Request | None = None
        # Later requests admitted ahead of this one while it waited and did not fit
        # (reset when it is admitted): the scheduler's fairness counter.
        self.passed_over = 0
        self.logprobs: list[TokenLogprob] | None = (
            [] if sampling_params.logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None)
        # Detokenized text so far (owned by the detokenizer).
        self.output_text = ""
        # Speculative tokens proposed for this step, not yet verified (the proposer keeps
        # the distributions sampled drafts were drawn from, beside the model).
        self.spec_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def uses_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits of every prompt position: compute them all."""
        return self.sampling_params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def waits_for_prefix(self) -> bool:
        """True while a sibling that shares this prompt has not computed it yet."""
        src = self.prefix_source
        if src is None:
            return False
        if src.is_finished or src.num_computed_tokens >= src.num_prompt_tokens:
            self.prefix_source = None
            return False
        return True

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.metrics.num_generated_tokens = self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, computed="
                f"{self.num_computed_tokens}/{self.num_tokens})")
