"""What a request returns: completions, logprobs and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A chosen token's log-probability under the model, with the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    # (token_id, logprob) of the most likely tokens, most likely first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    """Per-request timings in seconds (time.monotonic clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Speculative decoding: draft tokens verified for this request, and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # A reasoning model's output tokens between its thinking markers (set at the finish).
    num_thinking_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_generated_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the n completions of a request; text and token_ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # The stop string or stop token id that ended the completion, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    metrics: RequestMetrics | None = None
    # A reasoning model's text split in two (tokenmill/reasoning.py): the thinking
    # (None when there was none) and the answer. For other models content is text.
    reasoning_content: str | None = None
    content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # One entry per prompt token; the first is None (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    # Set when the engine failed this request (its completion ended with finish_reason
    # "error"); the other requests of the step it failed in went on.
    error: str | None = None

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics if self.outputs else None
