"""Serving the OpenAI endpoints: request -> SamplingParams -> engine streams -> response.

Prompts are tokenized and validated here, before anything is queued, so that every
validation error (bad field, prompt too long for the context) is a 400. That work
runs on a small pool of threads (the engine's InputProcessor is safe to call from
any thread), never on the event loop: a multi-megabyte prompt does not stall other
requests, streams or /health.
A non-streamed request whose client goes away is aborted (the connection is polled);
a streamed one is aborted when its response generator is closed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel

from tokenmill.engine.async_engine import AsyncLLMEngine, RequestStream
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import REQUEST_FIELDS, APIError, error_body, from_exception
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from tokenmill.server.shaping import ChatShaper, CompletionShaper, PromptInput, Shaper

_DISCONNECT_POLL_S = 0.25
# Threads that tokenize and validate prompts (tokenization itself is serialised by the
# tokenizer's lock; a second thread keeps validation and decoding moving meanwhile).
TOKENIZER_THREADS = 2
T = TypeVar("T")


class OpenAIServing:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str,
                 metrics: ServerMetrics, default_thinking_budget: int | None = None) -> None:
        self.async_engine = async_engine
        self.inputs = async_engine.engine.inputs
        self.tokenizer = async_engine.tokenizer
        self.model_name = model_name
        self.metrics = metrics
        # Whether the model reasons (its outputs split into reasoning and content).
        self.reasons = self.inputs.reasoning is not None
        if default_thinking_budget is not None and not self.reasons:
            raise ValueError("thinking_budget: a default thinking budget was given, but this "
                             "model does not reason (no thinking markers declared)")
        self.default_thinking_budget = default_thinking_budget
        self._token_text: dict[int, str] = {}
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenmill-inputs")

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run prompt work (tokenizing, validating, decoding) on the input threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- shared checks ---------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    async def chat_prompt(self, messages: list, add_generation_prompt: bool = True) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return await self.off_loop(self.inputs.chat, conversation, add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except TemplateError as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from exc

    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest,
                         max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         renamed: dict[str, str] | None = None) -> SamplingParams:
        """SamplingParams from the request's fields; `renamed` maps a SamplingParams
        field to the request field it came from (so an error names what was sent)."""
        def pick(value, default):
            return default if value is None else value

        thinking_budget = pick(req.thinking_budget, self.default_thinking_budget)
        try:
            return SamplingParams(
                n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
                temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0),
                top_k=pick(req.top_k, 0), min_p=pick(req.min_p, 0.0),
                presence_penalty=pick(req.presence_penalty, 0.0),
                frequency_penalty=pick(req.frequency_penalty, 0.0),
                repetition_penalty=pick(req.repetition_penalty, 1.0), seed=req.seed,
                stop=req.stop, stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                logit_bias=_logit_bias(req.logit_bias), thinking_budget=thinking_budget,
                min_thinking=pick(req.min_thinking, 0), thinking_bridge=req.thinking_bridge)
        except ValueError as exc:
            error = from_exception(exc, REQUEST_FIELDS | frozenset(renamed or ()))
            error.param = (renamed or {}).get(error.param, error.param)
            raise error from exc

    async def _check_prompt(self, prompt: PromptInput, params: SamplingParams,
                            requested_max_tokens: int | None) -> None:
        """OpenAI semantics: prompt + max_tokens beyond the context is an error."""
        num = len(prompt.token_ids)
        limit = self.async_engine.max_model_len
        if num >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {num}", param="prompt", code="context_length_exceeded")
        if requested_max_tokens is not None and num and num + requested_max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                           f"prompt has {num} tokens and max_tokens asks for "
                           f"{requested_max_tokens} more", param="max_tokens",
                           code="context_length_exceeded")
        try:
            await self.off_loop(self.inputs.validate, prompt.token_ids, params)
        except ValueError as exc:
            error = from_exception(exc, REQUEST_FIELDS)
            if error.param is None:
                error.param = "prompt"
            raise error from exc

    async def _completion_prompts(self, prompt: str | list) -> list[PromptInput]:
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        try:
            return [PromptInput(p, await self.off_loop(self.inputs.encode, p))
                    if isinstance(p, str) else PromptInput(None, list(p)) for p in prompt]
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc

    def _add_all(self, request_id: str, prompts: list[PromptInput], params: SamplingParams
                 ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for index, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(self.async_engine.add_request(sub_id, prompt.token_ids, params))
        except Exception as exc:
            for stream in streams:
                stream.cancel()
            raise from_exception(exc, REQUEST_FIELDS) from exc
        return streams

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    # ---- completions ------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of ({req.best_of}) must equal n ({req.n}): generating "
                           "more completions than are returned is not supported",
                           param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 is allowed only with echo)",
                           param="max_tokens")
        # echo with max_tokens=0 scores the prompt (lm-eval-harness loglikelihood): the
        # engine still samples one token, which is dropped.
        echo_only = req.echo and req.max_tokens == 0
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        if req.prompt_logprobs is not None:
            # The larger of the two (echo's alternatives are cut to logprobs); a negative
            # value goes through as it is, for SamplingParams to reject.
            prompt_logprobs = (max(prompt_logprobs, req.prompt_logprobs)
                               if prompt_logprobs is not None and req.prompt_logprobs >= 0
                               else req.prompt_logprobs)
        params = self._sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs,
                                       prompt_logprobs)
        prompts = await self._completion_prompts(req.prompt)
        for prompt in prompts:
            await self._check_prompt(prompt, params, req.max_tokens)
            if req.echo and prompt.text is None:
                prompt.text = await self.off_loop(self.inputs.decode, prompt.token_ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self._add_all(request_id, prompts, params)
        shaper = CompletionShaper(self, req, prompts, echo_only)

        def response(finals: list[RequestOutput]) -> CompletionResponse:
            choices = [c for i, final in enumerate(finals) for c in shaper.final(i, final)]
            return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=shaper.usage(finals))

        return await self._respond(req, raw, streams, shaper, request_id, response)

    # ---- chat -------------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        renamed = {"logprobs": "top_logprobs"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, renamed["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs, renamed=renamed)
        prompt = PromptInput(None, await self.chat_prompt(req.messages,
                                                          req.add_generation_prompt))
        await self._check_prompt(prompt, params, max_tokens)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self._add_all(request_id, [prompt], params)
        shaper = ChatShaper(self, req, [prompt])

        def response(finals: list[RequestOutput]) -> ChatCompletionResponse:
            return ChatCompletionResponse(id=request_id, model=self.model_name,
                                          choices=shaper.final(0, finals[0]),
                                          usage=shaper.usage(finals))

        return await self._respond(req, raw, streams, shaper, request_id, response)

    # ---- driving the streams -----------------------------------------------------------
    async def _respond(self, req, raw: Request, streams: list[RequestStream], shaper,
                       request_id: str, build_response) -> Response:
        """Stream server-sent events, or wait for every completion and build one body."""
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self._stream(streams, shaper, request_id, include_usage))
        finals = await self._collect(streams, raw)
        if finals is None:
            return Response(status_code=499)
        return _json(build_response(finals))

    async def _collect(self, streams: list[RequestStream], raw: Request
                       ) -> list[RequestOutput] | None:
        """Final outputs in prompt order, or None when the client went away (aborted)."""
        async def last_output(stream: RequestStream) -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            assert final is not None and final.finished
            self.metrics.record_finished(final)
            return final

        tasks = [asyncio.ensure_future(last_output(s)) for s in streams]
        gathered = asyncio.gather(*tasks)
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not gathered.done():
                return None
            try:
                return gathered.result()
            except Exception as exc:
                raise from_exception(exc, REQUEST_FIELDS) from exc
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.cancel()
            if not gathered.done():
                gathered.cancel()
            # Retrieve the outcome so asyncio does not log "exception never retrieved".
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _stream(self, streams: list[RequestStream], shaper: Shaper, request_id: str,
                      include_usage: bool) -> AsyncIterator[str]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            for chunk in shaper.start_chunks(request_id):
                yield _event(chunk)
            async for index, output in _merge(streams):
                for chunk in shaper.delta_chunks(request_id, index, output):
                    yield _event(chunk)
                if output.finished:
                    finals[index] = output
                    self.metrics.record_finished(output)
            if include_usage:
                yield _event(shaper.usage_chunk(request_id, finals))
        except Exception as exc:
            error = from_exception(exc, REQUEST_FIELDS)
            yield f"data: {json.dumps(error_body(error.status, error.message, error.param, error.code))}\n\n"
        finally:
            for stream in streams:
                stream.cancel()
        yield "data: [DONE]\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()


async def _wait_for_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")



def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends logit_bias keyed by token ids written as strings."""
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias must be keyed by token ids (integers as strings), got "
                         f"{sorted(bias)[:4]}") from None
