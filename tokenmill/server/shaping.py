"""Shaping engine outputs into OpenAI response objects, whole or as stream deltas.

Engine outputs are cumulative; a shaper remembers, per choice, how much text and how
many tokens it has already sent, so each stream chunk carries only what is new.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from tokenmill.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tokenmill.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionStreamResponse,
    CompletionTokensDetails,
    DeltaMessage,
    PromptLogprob,
    RequestTimings,
    TopLogprob,
    UsageInfo,
)


class Namer(Protocol):
    """What a shaper needs from the server: the model's name and token texts."""

    model_name: str
    reasons: bool  # the model reasons: usage counts its thinking tokens

    def token_text(self, token_id: int) -> str: ...


@dataclass
class PromptInput:
    """A prompt as sent (text, when it was text) and as tokens."""

    text: str | None
    token_ids: list[int]


class Shaper:
    """Turns engine outputs into one endpoint's response objects."""

    def __init__(self, serving: Namer, req, prompts: list[PromptInput]) -> None:
        self.serving = serving
        self.req = req
        self.prompts = prompts
        self.n = req.n
        num_choices = len(prompts) * req.n
        self.sent_chars = [0] * num_choices
        self.sent_reasoning_chars = [0] * num_choices
        self.sent_tokens = [0] * num_choices
        self.done = [False] * num_choices

    def usage(self, finals: list[RequestOutput | None]) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        choices = [c for f in finals if f is not None for c in f.outputs]
        completion = sum(self._num_completion_tokens(c) for c in choices)
        details = None
        if self.serving.reasons:
            details = CompletionTokensDetails(reasoning_tokens=sum(
                c.metrics.num_thinking_tokens for c in choices if c.metrics is not None))
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion,
                         completion_tokens_details=details)

    def _num_completion_tokens(self, choice: CompletionOutput) -> int:
        return len(choice.token_ids)

    def _take_delta(self, index: int, choice: CompletionOutput, full_text: str | None = None
                    ) -> tuple[str, list[int], bool]:
        """New text (of full_text, default the choice's text), new token positions and
        whether the choice just finished."""
        full_text = choice.text if full_text is None else full_text
        text = full_text[self.sent_chars[index]:]
        self.sent_chars[index] = len(full_text)
        start = self.sent_tokens[index]
        self.sent_tokens[index] = len(choice.token_ids)
        just_finished = choice.finished and not self.done[index]
        self.done[index] = self.done[index] or choice.finished
        return text, list(range(start, len(choice.token_ids))), just_finished

    def start_chunks(self, request_id: str) -> list[BaseModel]:
        return []

    def delta_chunks(self, request_id: str, prompt_index: int, output: RequestOutput
                     ) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self, request_id: str, finals: list[RequestOutput | None]) -> BaseModel:
        raise NotImplementedError


class CompletionShaper(Shaper):
    def __init__(self, serving: Namer, req: CompletionRequest, prompts: list[PromptInput],
                 echo_only: bool) -> None:
        super().__init__(serving, req, prompts)
        self.echo_only = echo_only
        self.echoed = [False] * len(self.done)
        self.prompt_logprobs_sent = [False] * len(self.done)

    def _num_completion_tokens(self, choice: CompletionOutput) -> int:
        return 0 if self.echo_only else len(choice.token_ids)

    def _logprobs(self, prompt: PromptInput, output: RequestOutput, choice: CompletionOutput,
                  positions: list[int], with_prompt: bool, offset: int) -> CompletionLogprobs:
        entries: list[tuple[int, TokenLogprob | None]] = []
        if with_prompt:
            prompt_lps = output.prompt_logprobs or [None] * len(prompt.token_ids)
            entries += list(zip(prompt.token_ids, prompt_lps, strict=False))
        if not self.echo_only and choice.logprobs is not None:
            entries += [(choice.token_ids[i], choice.logprobs[i]) for i in positions
                        if i < len(choice.logprobs)]
        result = CompletionLogprobs()
        for token_id, logprob in entries:
            text = self.serving.token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if logprob is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(logprob.logprob)
            # Several ids can decode to the same text (partial UTF-8 bytes); keep the most
            # likely, as `top` is sorted most likely first. A prompt token may carry more
            # alternatives (prompt_logprobs asked for more): logprobs says how many.
            top: dict[str, float] = {}
            for alt_id, alt_logprob in logprob.top[:self.req.logprobs]:
                top.setdefault(self.serving.token_text(alt_id), alt_logprob)
            top.setdefault(text, logprob.logprob)
            result.top_logprobs.append(top)
        return result

    def _prompt_logprobs(self, prompt: PromptInput, entries: list[TokenLogprob | None]
                         ) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per position, the prompt's token and the top N."""
        token_text = self.serving.token_text
        shaped: list[dict[str, PromptLogprob] | None] = []
        for token_id, entry in zip(prompt.token_ids, entries, strict=False):
            if entry is None:
                shaped.append(None)
                continue
            ranked = {str(alt_id): PromptLogprob(logprob=lp, rank=rank,
                                                 decoded_token=token_text(alt_id))
                      for rank, (alt_id, lp) in enumerate(
                          entry.top[:self.req.prompt_logprobs], start=1)}
            ranked.setdefault(str(token_id), PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=token_text(token_id)))
            shaped.append(ranked)
        return shaped

    def _choice(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput,
                final: bool) -> CompletionChoice | None:
        index = prompt_index * self.n + choice.index
        prompt = self.prompts[prompt_index]
        already = self.sent_chars[index]
        text, positions, just_finished = self._take_delta(index, choice)
        if self.echo_only:
            text, positions = "", []
        echo_now = self.req.echo and not self.echoed[index]
        self.echoed[index] = self.echoed[index] or self.req.echo
        offset = already + (len(prompt.text or "") if self.req.echo else 0)
        if echo_now:
            text = (prompt.text or "") + text
            offset = 0
        # A chunk for every step with new tokens, its text empty where they decode to
        # none yet (a character's first bytes), as vLLM and llama-server send: a client
        # sees each token arrive (its time to first token, its inter-token latency).
        if not final and not text and not positions and not just_finished:
            return None
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = self._logprobs(prompt, output, choice, positions, echo_now, offset)
        prompt_logprobs = None
        if (self.req.prompt_logprobs is not None and output.prompt_logprobs is not None
                and not self.prompt_logprobs_sent[index]):
            self.prompt_logprobs_sent[index] = True
            prompt_logprobs = self._prompt_logprobs(prompt, output.prompt_logprobs)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            finish_reason=choice.finish_reason if just_finished or final else None,
            stop_reason=choice.stop_reason if just_finished or final else None,
            timings=timings(choice) if final else None)

    def final(self, prompt_index: int, output: RequestOutput) -> list[CompletionChoice]:
        return [self._choice(prompt_index, output, c, final=True) for c in output.outputs]

    def delta_chunks(self, request_id: str, prompt_index: int, output: RequestOutput
                     ) -> list[BaseModel]:
        chunks = []
        for choice in output.outputs:
            shaped = self._choice(prompt_index, output, choice, final=False)
            if shaped is not None:
                chunks.append(CompletionStreamResponse(id=request_id, model=self.serving.model_name,
                                                       choices=[shaped]))
        return chunks

    def usage_chunk(self, request_id: str, finals: list[RequestOutput | None]) -> BaseModel:
        return CompletionStreamResponse(id=request_id, model=self.serving.model_name, choices=[],
                                        usage=self.usage(finals))


class ChatShaper(Shaper):
    def _logprobs(self, choice: CompletionOutput, positions: list[int]) -> ChatChoiceLogprobs:
        entries = []
        token_text = self.serving.token_text
        for i in positions:
            if choice.logprobs is None or i >= len(choice.logprobs):
                break
            logprob = choice.logprobs[i]
            text = token_text(logprob.token_id)
            top = [TopLogprob(token=token_text(t), logprob=lp,
                              bytes=list(token_text(t).encode()))
                   for t, lp in logprob.top]
            entries.append(ChatLogprobEntry(token=text, logprob=logprob.logprob,
                                            bytes=list(text.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=entries)

    def final(self, prompt_index: int, output: RequestOutput) -> list[ChatChoice]:
        choices = []
        for choice in output.outputs:
            positions = list(range(len(choice.token_ids)))
            message = ChatResponseMessage(content=_content(choice),
                                          reasoning_content=choice.reasoning_content)
            choices.append(ChatChoice(
                index=choice.index, message=message,
                logprobs=self._logprobs(choice, positions) if self.req.logprobs else None,
                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                timings=timings(choice)))
        return choices

    def start_chunks(self, request_id: str) -> list[BaseModel]:
        return [ChatCompletionStreamResponse(
            id=request_id, model=self.serving.model_name,
            choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(self.n)])]

    def delta_chunks(self, request_id: str, prompt_index: int, output: RequestOutput
                     ) -> list[BaseModel]:
        chunks = []
        for choice in output.outputs:
            text, positions, just_finished = self._take_delta(choice.index, choice,
                                                              _content(choice))
            reasoning = (choice.reasoning_content or "")[self.sent_reasoning_chars[choice.index]:]
            self.sent_reasoning_chars[choice.index] += len(reasoning)
            if not text and not reasoning and not positions and not just_finished:
                continue  # new tokens with no text yet still send a chunk (as above)
            shaped = ChatStreamChoice(
                index=choice.index,
                delta=DeltaMessage(content=text or (None if reasoning else ""),
                                   reasoning_content=reasoning or None),
                logprobs=self._logprobs(choice, positions) if self.req.logprobs else None,
                finish_reason=choice.finish_reason if just_finished else None,
                stop_reason=choice.stop_reason if just_finished else None)
            chunks.append(ChatCompletionStreamResponse(id=request_id,
                                                       model=self.serving.model_name,
                                                       choices=[shaped]))
        return chunks

    def usage_chunk(self, request_id: str, finals: list[RequestOutput | None]) -> BaseModel:
        return ChatCompletionStreamResponse(id=request_id, model=self.serving.model_name,
                                            choices=[], usage=self.usage(finals))


def _content(choice: CompletionOutput) -> str:
    """The answer a chat message carries: a reasoning model's text after its thinking."""
    return choice.text if choice.content is None else choice.content


def timings(choice: CompletionOutput) -> RequestTimings | None:
    m = choice.metrics
    if m is None:
        return None
    return RequestTimings(queue_time=m.queue_time, time_to_first_token=m.time_to_first_token,
                          time_per_output_token=m.time_per_output_token,
                          e2e_latency=m.e2e_latency)
