"""From a request's tokens to what the user sees: stop checks and RequestOutputs.

A user request with n completions is a RequestGroup of n child Requests (n > 1
children share the prompt's blocks through the prefix cache), each with its own
incremental detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.request import Request
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.reasoning import ReasoningMarkers, split_reasoning


@dataclass
class RequestGroup:
    """One user request: a prompt and its n sampled completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    # A reasoning model's markers: outputs carry reasoning_content and content.
    reasoning: ReasoningMarkers | None = None

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)


def check_stop(request: Request, token: int, detok: IncrementalDetokenizer,
               max_model_len: int) -> str | None:
    """Detokenize the token just appended; the finish reason if the request stops now."""
    params = request.sampling_params
    may_stop = request.num_output_tokens >= params.min_tokens
    stop_string = detok.add_token(request, token, find_stop=may_stop)
    if may_stop:
        if not params.ignore_eos and token in request.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            request.stop_reason = token
            return "stop"
        if stop_string is not None:
            request.stop_reason = stop_string
            return "stop"
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None


def group_output(group: RequestGroup) -> RequestOutput:
    """The group's cumulative output: text and tokens per completion so far."""
    outputs = []
    for index, (child, detok) in enumerate(zip(group.children, group.detokenizers,
                                               strict=True)):
        text = detok.visible_text(child)
        reasoning, content = None, text
        if group.reasoning is not None:
            open_at_start = child.thinking is not None and child.thinking.open_at_start
            reasoning, content = split_reasoning(text, group.reasoning, open_at_start,
                                                 finished=child.is_finished)
        outputs.append(CompletionOutput(
            index=index, text=text, token_ids=child.output_token_ids,
            finish_reason=child.finish_reason, stop_reason=child.stop_reason,
            logprobs=list(child.logprobs) if child.logprobs is not None else None,
            cumulative_logprob=child.cumulative_logprob if child.logprobs is not None else None,
            metrics=child.metrics, reasoning_content=reasoning, content=content))
    first = group.children[0]
    error = next((child.error for child in group.children if child.error), None)
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                         group.finished, prompt_logprobs=first.prompt_logprobs,
                         num_cached_tokens=first.metrics.num_cached_tokens, error=error)
