"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every failure the server reports goes through `APIError` or one of the handlers
installed by `install_error_handlers`, so clients always get the same JSON shape.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineStoppedError, QueueFullError, RequestFailedError
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    TokenizeRequest,
)

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}
# Every request field a client may send: what a ValueError's leading word may name.
REQUEST_FIELDS = (frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
                  | frozenset(TokenizeRequest.model_fields))
_FIELD_AT_START = re.compile(r"^([a-z_]+)\b:?")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    error_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    info = ErrorInfo(message=message, type=error_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def from_exception(exc: BaseException, fields: set[str] | frozenset[str] = frozenset()
                   ) -> APIError:
    """Map an engine-side exception to the API error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        match = _FIELD_AT_START.match(str(exc))
        param = match.group(1) if match and match.group(1) in fields else None
        return APIError(400, str(exc), param=param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full",
                        headers={"Retry-After": str(max(1, round(exc.retry_after)))})
    if isinstance(exc, EngineStoppedError):
        return APIError(503, str(exc), code="unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="engine_error")
    logger.error("unexpected error serving a request", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", code="internal_error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if first.get("type") == "model_attributes_type" and tuple(first.get("loc", ())) == ("body",):
        return ("the request body must be a JSON object sent with Content-Type: "
                "application/json", None)
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # The request field the client sent (a union's member names, list indices and
    # nested keys after it are pydantic's path, not OpenAI's param).
    param = loc[0] if loc else None
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
             f"{e.get('msg', 'invalid')}" for e in errors[:5]]
    return "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 400 and "parsing the body" in message:
            message = "request body could not be parsed (malformed JSON or invalid UTF-8)"
        return error_response(status, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc, REQUEST_FIELDS).response()
