"""Every error a client sees, mapped to HTTP here: as `{"error": {"code", "message"}}`, or
on the OpenAI-compatible routes (`/v1/...`) in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, with the same statuses and codes."""

from __future__ import annotations

import http
import json
import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry.trace import get_current_span
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from engine.errors import (
    BatchFailed,
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineUnavailable,
    NotReady,
    QueueFull,
    UnknownModel,
)
from models.errors import (
    CorruptImage,
    ImageTooLarge,
    InputError,
    InvalidParameter,
    UnsupportedImage,
)

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error raised by the HTTP layer itself."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.param = param  # the request field at fault, where one is


def malformed(message: str) -> ApiError:
    return ApiError(400, "malformed_request", message)


def payload_too_large(limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")


def too_many_uploads(budget: int) -> ApiError:
    message = f"this process already holds {budget} bytes of request bodies; retry shortly"
    return ApiError(503, "too_many_uploads", message, {"Retry-After": "1"})


def not_ready(message: str = "the models are still loading") -> ApiError:
    return ApiError(503, "not_ready", message, {"Retry-After": "5"})


def unsupported_media_type(accepted: str) -> ApiError:
    return ApiError(415, "unsupported_media_type", f"send {accepted}")


def request_timeout(limit_s: float) -> ApiError:
    return ApiError(
        408, "request_timeout", f"the request did not arrive whole within {limit_s:g} s"
    )


def headers_too_large(max_bytes: int, max_fields: int) -> ApiError:
    return ApiError(
        431,
        "headers_too_large",
        f"the request's head exceeds {max_bytes} bytes or {max_fields} header fields",
    )


def malformed_http() -> ApiError:
    return ApiError(400, "malformed_http", "the request is not valid HTTP/1.1")


# Errors that Starlette and FastAPI raise themselves, by status.
_HTTP_CODES = {
    400: "malformed_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _from_http_exception(exc: StarletteHTTPException) -> ApiError:
    status = exc.status_code
    code = _HTTP_CODES.get(status)
    if code is None:  # a status of no route of Texel's: named after its phrase
        code = http.HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    return ApiError(status, code, str(exc.detail), dict(exc.headers or {}))


_INPUT_STATUS: dict[type[InputError], int] = {
    UnsupportedImage: 415,
    ImageTooLarge: 413,
    CorruptImage: 400,
    InvalidParameter: 422,
}


def to_api_error(exc: Exception) -> ApiError:
    """The one mapping from domain errors to HTTP statuses."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StarletteHTTPException):
        return _from_http_exception(exc)
    if isinstance(exc, ClientDisconnect):  # gone while its body was being read
        return ApiError(499, "client_closed_request", "the client disconnected")
    if isinstance(exc, InputError):
        status = _INPUT_STATUS.get(type(exc), 400)
        return ApiError(status, exc.code, exc.message, param=exc.param)
    if isinstance(exc, QueueFull):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return ApiError(429, exc.code, exc.message, {"Retry-After": retry})
    if isinstance(exc, DeadlineExceeded):
        return ApiError(504, exc.code, exc.message)
    if isinstance(exc, Draining):
        return ApiError(503, exc.code, exc.message, {"Retry-After": "1"})
    if isinstance(exc, Cancelled):
        return ApiError(499, exc.code, exc.message)
    if isinstance(exc, NotReady):
        return ApiError(503, exc.code, exc.message, {"Retry-After": "5"})
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, exc.code, exc.message, {"Retry-After": "1"})
    if isinstance(exc, UnknownModel):
        return ApiError(404, "model_disabled", exc.message)
    if isinstance(exc, BatchFailed | BatchingError):
        return ApiError(500, exc.code, exc.message)
    return ApiError(500, "internal_error", "an unexpected error occurred; see the server log")


def _field(error: dict) -> str:
    return ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query")) or "body"


def validation_error(errors: list) -> ApiError:
    """Fields of a request that do not match its schema: 422, each field named."""
    details = "; ".join(f"{_field(e)}: {e.get('msg')}" for e in errors)
    return ApiError(422, "invalid_parameter", details, param=_field(errors[0]) if errors else None)


OPENAI_PREFIX = "/v1/"


def openai_type(status: int) -> str:
    """The `type` of an error in OpenAI's shape, from its status."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )


def error_content(error: ApiError, path: str = "") -> dict:
    """The JSON body of an error on the route at `path`: OpenAI's shape under `/v1/`,
    Texel's elsewhere."""
    if path.startswith(OPENAI_PREFIX):
        detail = {
            "message": error.message,
            "type": openai_type(error.status),
            "param": error.param,
            "code": error.code,
        }
        return {"error": detail}
    return {"error": {"code": error.code, "message": error.message}}


def error_body(error: ApiError) -> bytes:
    """The JSON body of an error, for answers written below the app (app/server.py)."""
    return json.dumps(error_content(error), separators=(",", ":")).encode()


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    """The answer of an error on the route at `path` (its body's shape depends on it)."""
    return JSONResponse(error_content(error, path), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        # What went wrong, on the request's server span, as a route puts it there
        # (app/routes.py): a trace backend finds a refused request by its code.
        get_current_span().set_attribute("texel.error.code", error.code)
        return error_response(error, request.url.path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # Query parameters (the bodies of the routes are validated in app/http.py).
        return answer(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        bare = path.rstrip("/")
        if exc.status_code == 404 and bare != path and _routed(app, request, bare):
            # Not redirected (the app is built with redirect_slashes off): a redirect
            # names the host the client sent, and most clients do not follow a POST's.
            message = f"no route {path}; the route is {bare}, without the trailing slash"
            return answer(request, ApiError(404, "not_found", message))
        return answer(request, to_api_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # repr: the path is the client's, decoded, and may hold line breaks
        log.exception("unhandled error on %r", request.url.path)
        return answer(request, to_api_error(exc))


def _routed(app: FastAPI, request: Request, path: str) -> bool:
    """Whether a route of `app` takes `request` at `path` instead (any method)."""
    scope = {**request.scope, "path": path}
    return any(route.matches(scope)[0] is not Match.NONE for route in app.router.routes)
