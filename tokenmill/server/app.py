"""The FastAPI app: OpenAI-compatible routes, auth, body limit, health and metrics.

`build_app` takes an AsyncLLMEngine whose model is already loaded, so /health is
200 as soon as the app answers at all (and 503 once shutdown has begun).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server.errors import APIError, error_body, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openai_serving import OpenAIServing
from tokenmill.server.profile_routes import add_profile_routes
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20

_ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse, "description": what} for status, what in (
        (400, "invalid request"), (401, "missing or wrong API key"),
        (404, "unknown model"), (413, "body too large"),
        (429, "at capacity; see Retry-After"), (500, "the engine failed the request"),
        (503, "shutting down; see Retry-After"))}


def _generation_responses(model: type) -> dict[int | str, dict]:
    ok = {"model": model, "description": "the response, or server-sent events when stream=true",
          "content": {"text/event-stream": {}}}
    return {200: ok, **_ERROR_RESPONSES}


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over max_bytes (declared or streamed).

    The body is read here, up to the limit, and replayed to the app; later receive()
    calls go to the server, so disconnect detection still works.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(
            error_body(413, f"request body is larger than {self.max_bytes} bytes"),
            status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


def _auth_dependency(api_key: str | None):
    expected = api_key.encode() if api_key else None

    async def check_api_key(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 expected):
            raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer "
                           "<key>'", code="invalid_api_key")

    return check_api_key


def build_app(async_engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, shutdown_grace_s: float = 10.0,
              default_thinking_budget: int | None = None) -> FastAPI:
    """The app; default_thinking_budget applies to requests that send none (a
    ValueError when the model does not reason)."""
    metrics = ServerMetrics(async_engine, served_model_name)
    serving = OpenAIServing(async_engine, served_model_name, metrics, default_thinking_budget)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await async_engine.shutdown(shutdown_grace_s)
        serving.close()

    app = FastAPI(title="tokenmill", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.serving = serving

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_alive and async_engine.accepting:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine is not serving"), status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    api = APIRouter(dependencies=[Depends(_auth_dependency(api_key))])
    _add_generation_routes(api, serving, served_model_name)
    _add_token_routes(api, serving)
    add_profile_routes(api, async_engine)
    app.include_router(api)
    _document_400_not_422(app)
    return app


def _add_generation_routes(api: APIRouter, serving: OpenAIServing, model_name: str) -> None:
    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name,
                                         max_model_len=serving.async_engine.max_model_len)])

    @api.post("/v1/completions", response_model=None,
              responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.create_completion(body, raw)

    @api.post("/v1/chat/completions", response_model=None,
              responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.create_chat_completion(body, raw)


def _add_token_routes(api: APIRouter, serving: OpenAIServing) -> None:
    @api.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            tokens = await serving.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            tokens = await serving.off_loop(serving.inputs.encode, body.prompt,
                                            body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens),
                                max_model_len=serving.async_engine.max_model_len)

    @api.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        vocab = serving.inputs.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"tokens must be integers in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await serving.off_loop(serving.inputs.decode,
                                                                 body.tokens))


def _document_400_not_422(app: FastAPI) -> None:
    """Validation errors are answered with 400 (OpenAI's choice), so the schema says so."""
    build_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build_schema()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema

    app.openapi = openapi
