"""Every error a client sees, as `{"error": {"code", "message"}}`, mapped to HTTP here."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
from telemetry import metrics

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error raised by the HTTP layer itself."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def malformed(message: str) -> ApiError:
    return ApiError(400, "malformed_request", message)


def payload_too_large(limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")


def not_ready(message: str = "the models are still loading") -> ApiError:
    return ApiError(503, "not_ready", message, {"Retry-After": "5"})


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
    if isinstance(exc, InputError):
        return ApiError(_INPUT_STATUS.get(type(exc), 400), exc.code, exc.message)
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


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": error.code, "message": error.message}},
        status_code=error.status,
        headers=error.headers,
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        # A body that is not JSON at all is malformed; JSON with bad values is 422.
        if any(e.get("type") in ("json_invalid", "model_attributes_type") for e in errors):
            return error_response(malformed("the body is not a valid JSON object"))
        key = {"/generate": "image", "/recognize": "formula"}.get(request.url.path)
        if key:
            metrics.REJECTED.labels(request.app.state.runtime.model_label(key), "invalid").inc()
        details = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
            for e in errors
        )
        return error_response(ApiError(422, "invalid_parameter", details))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(ApiError(exc.status_code, code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(to_api_error(exc))
