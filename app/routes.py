"""Texel's HTTP routes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import time
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry.trace import Span, get_current_span
from starlette.background import BackgroundTask

from app import openai_api
from app.errors import ApiError, error_response, openai_type, to_api_error
from app.http import (
    ROUTE_MODELS,
    check_api_key,
    preferred_type,
    read_image_upload,
    read_json,
    unless_disconnected,
)
from app.recognition_cache import RecognitionCache
from app.schemas import (
    MAX_SIDE,
    MAX_STEPS,
    SIZE_MULTIPLE,
    ErrorBody,
    GeneratedImage,
    GenerateRequest,
    GenerateResponse,
    ImagesGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
    Readiness,
    RecognizeJSON,
    RecognizeResponse,
)
from app.serving import Runtime
from app.settings import Settings
from engine import Cancelled, DeadlineExceeded, Draining, QueueFull
from models.errors import InputError
from telemetry import RequestTrace, metrics

if TYPE_CHECKING:
    from engine import BatchResult
    from models.image.adapter import EncodedImages

log = logging.getLogger(__name__)

# An image hashed for the recognition cache above this size is hashed on the thread pool
# (hashlib lets go of the GIL), not on the event loop.
HASH_INLINE_BYTES = 1 << 20


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """Serve the OpenAPI document with the limits of this server's settings in it; make
    the process's recognition cache; note when the server started (for /v1/models)."""
    settings = app.state.runtime.settings
    generic = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = state_limits(generic(), settings)
        return app.openapi_schema

    app.openapi = openapi
    decoding = settings.formula.advanced
    app.state.recognition_cache = RecognitionCache.of_megabytes(
        settings.formula.cache_mb,
        variant=(decoding.decoder, decoding.num_beams, decoding.max_new_tokens),
    )
    app.state.started = int(time.time())
    yield


router = APIRouter(lifespan=_lifespan)

# What /generate can answer, by the `Accept` header, in the order it prefers them.
GENERATE_ANSWERS = ("application/json", "image/png", "text/event-stream")
ERRORS = {
    status: {"model": ErrorBody, "description": text}
    for status, text in {
        400: "Malformed request: not valid JSON or multipart, an empty body, no image.",
        401: "Missing or wrong API key.",
        404: "The route's model is disabled.",
        408: "The request did not arrive whole within the request timeout.",
        413: "Upload too large, in bytes or pixels.",
        415: "Not a supported image, or a body that is not JSON, multipart or an image.",
        422: "A field is unknown, missing, of the wrong type or out of range.",
        429: "Queue full; retry after `Retry-After` seconds.",
        503: "Models not ready yet, or the server is draining.",
        504: "The request's deadline passed.",
    }.items()
}
OPENAI_ERRORS = {
    status: {
        "model": OpenAIErrorBody,
        "description": f"{answer['description']} `type` {openai_type(status)}.",
    }
    for status, answer in ERRORS.items()
}


def state_limits(document: dict, settings: Settings) -> dict:
    """Write the limits the server enforces with these settings into its OpenAPI
    document, so that a client generated from it sends what the server accepts."""
    document = copy.deepcopy(document)  # the routes' own schemas are shared by every app
    paths = document["paths"]
    generate = paths["/generate"]["post"]["requestBody"]["content"]["application/json"]
    fields = generate["schema"]["properties"]
    side = min(settings.image.max_side, MAX_SIDE)
    for name in ("width", "height"):
        _bound(fields[name], maximum=side - side % SIZE_MULTIPLE)
    _bound(fields["num_inference_steps"], maximum=min(settings.image.max_steps, MAX_STEPS))
    upload = f" At most {settings.max_upload_bytes} bytes and {settings.max_image_pixels} pixels."
    recognize = paths["/recognize"]["post"]["requestBody"]["content"]
    recognize["multipart/form-data"]["schema"]["properties"]["image"]["description"] += upload
    recognize["application/json"]["schema"]["properties"]["image_base64"]["description"] += upload
    recognize["image/*"]["schema"]["description"] += upload
    return document


def _bound(field: dict, **limits) -> None:
    """Set `limits` on the integer form of a field (an optional one is `anyOf` null)."""
    for form in field.get("anyOf", [field]):
        if form.get("type") == "integer":
            form.update(limits)


def runtime_of(request: Request) -> Runtime:
    return request.app.state.runtime


async def authorized(request: Request) -> None:
    # async: a plain `def` dependency costs every request a hop through a worker thread
    check_api_key(request, runtime_of(request).settings.api_keys)


class _Observed:
    """Counts a request in flight and records its duration and status: until its answer
    is made, or, for a streamed answer, until its stream has ended."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.streaming = False  # a stream's background task ends it, not __exit__

    def __enter__(self):
        self.started = time.perf_counter()
        metrics.INFLIGHT.labels(self.route).inc()
        return self

    def finish(self, status: int, trace_id: str | None) -> None:
        metrics.REQUEST_DURATION.labels(self.route, str(status)).observe(
            time.perf_counter() - self.started,
            exemplar={"trace_id": trace_id} if trace_id else None,
        )

    def until_streamed(self, response: StreamingResponse, trace_id: str | None) -> None:
        """Keep the request in flight, and its duration running, until `response`'s
        stream ends: its work runs while its events go out. Starlette runs the background
        task once the stream has ended, finished or its client gone."""
        self.streaming = True
        response.background = BackgroundTask(self._streamed, response.status_code, trace_id)

    def _streamed(self, status: int, trace_id: str | None) -> None:
        self.finish(status, trace_id)
        metrics.INFLIGHT.labels(self.route).dec()

    def __exit__(self, *exc_info):
        if not self.streaming:
            metrics.INFLIGHT.labels(self.route).dec()


async def _handle(request: Request, route: str, flow) -> Response:
    """Common shape of an inference request: checks, stages, metrics and error mapping
    (the error's body in the shape of the route: app/errors.py)."""
    runtime = runtime_of(request)
    key = ROUTE_MODELS[route]
    with _Observed(route) as observed:
        trace: RequestTrace | None = None
        try:
            model = await runtime.ready_model(key)
            trace = RequestTrace(model.name, model.operation)
            response = await flow(runtime, model.name, trace)
            if isinstance(response, StreamingResponse):  # it ends with its events
                observed.until_streamed(response, trace.trace_id)
            else:
                observed.finish(response.status_code, trace.trace_id)
            return response
        except Exception as exc:
            error = to_api_error(exc)
            _record_error(runtime, route, exc, error, trace, get_current_span())
            observed.finish(error.status, trace.trace_id if trace else None)
            return error_response(error, request.url.path)


def _record_error(
    runtime: Runtime,
    route: str,
    exc: Exception,
    error: ApiError,
    trace: RequestTrace | None,
    span: Span,
) -> None:
    """What went wrong with a request on `route`: its code on the request's server `span`
    (a trace backend finds it by code), and counted once (see `_rejection`)."""
    span.set_attribute("texel.error.code", error.code)
    reason = _rejection(exc, error, trace)
    if reason is not None:
        metrics.REJECTED.labels(runtime.model_label(ROUTE_MODELS[route]), reason).inc()
    if error.code == "internal_error":
        log.error("%s failed", route, exc_info=exc)


# The reasons of `texel_requests_rejected_total` given where a request is answered, by
# the error's code; refusals of a batcher (a full queue, a deadline, a cancelled or
# draining request) are counted by the batcher itself.
_REFUSALS = {
    "client_closed_request": "cancelled",  # gone before it reached an engine
    "draining": "draining",
    "not_ready": "not_ready",
    "model_failed": "not_ready",
    "unavailable": "unavailable",
    "engine_unavailable": "unavailable",
    "stalled": "unavailable",
    "too_many_uploads": "uploads",  # the process's budget of request bodies
}


def _rejection(exc: Exception, error: ApiError, trace: RequestTrace | None) -> str | None:
    """The reason to count a request's error under, or None if it is already counted
    (by the batcher of the engine it reached)."""
    if isinstance(exc, QueueFull | DeadlineExceeded | Cancelled | Draining):
        return None
    if error.code == "client_closed_request" and trace is not None and trace.in_engine:
        return None
    if error.status >= 500 and error.status not in (503, 504):
        return "failed"
    if error.code in _REFUSALS:
        return _REFUSALS[error.code]
    if isinstance(exc, InputError | ApiError) and error.status < 500:
        return "invalid"
    return None


def _generate_response(
    images: EncodedImages, result: BatchResult, model: str, trace: RequestTrace
) -> GenerateResponse:
    return GenerateResponse(
        images=[
            GeneratedImage(png_base64=base64.b64encode(p).decode("ascii"), seed=s)
            for p, s in zip(images.pngs, images.seeds, strict=True)
        ],
        model=model,
        batch_size=result.batch_size,
        timings_ms=trace.timings_ms,
    )


async def _generated(
    request: Request, runtime: Runtime, body: GenerateRequest, trace: RequestTrace
) -> tuple[EncodedImages, BatchResult]:
    """The images of a validated /generate request and the facts of their batch: the one
    path of every image route."""
    return await unless_disconnected(request, runtime.serve("image", _image_request(body), trace))


def _image_request(body: GenerateRequest):
    """The image model's request for a validated /generate body."""
    from models.image.adapter import ImageRequest

    return ImageRequest(**body.model_dump())


@router.post(
    "/recognize",
    response_model=RecognizeResponse,
    responses=ERRORS,
    dependencies=[Depends(authorized)],
    summary="Recognize a printed formula",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["image"],
                        "properties": {
                            "image": {
                                "type": "string",
                                "format": "binary",
                                "description": "The image file (PNG, JPEG, WebP, BMP or GIF).",
                            }
                        },
                    }
                },
                "application/json": {"schema": RecognizeJSON.model_json_schema()},
                "image/*": {
                    "schema": {
                        "type": "string",
                        "format": "binary",
                        "description": "The image file itself as the body.",
                    }
                },
            },
        }
    },
)
async def recognize(request: Request) -> Response:
    """A picture of a printed math formula (PNG, JPEG, WebP, BMP, GIF) in, LaTeX out.

    Send the file as multipart field `image`, as JSON `{"image_base64": "..."}`, or as the
    body itself with `Content-Type: image/png` (or any `image/*`).
    """

    cache: RecognitionCache = request.app.state.recognition_cache

    async def flow(runtime: Runtime, model: str, trace: RequestTrace) -> Response:
        key = None
        with trace.stage("http.parse"):
            data = await read_image_upload(request, runtime.settings.max_upload_bytes)
            if cache.enabled:
                key = await _cache_key(runtime, cache, data, model)
        if key is not None:
            cached = cache.get(key)
            trace.parent.set_attribute("texel.cache.hit", cached is not None)
            if cached is not None:
                metrics.RECOGNITION_CACHE_HITS.labels(model).inc()
                body = RecognizeResponse(
                    latex=cached.latex,
                    latex_compact=cached.compact,
                    confidence=cached.confidence,
                    model=model,
                    batch_size=0,
                    timings_ms=trace.timings_ms,
                    cached=True,
                )
                return JSONResponse(body.model_dump())
            metrics.RECOGNITION_CACHE_MISSES.labels(model).inc()
        recognized, result = await unless_disconnected(
            request, runtime.serve("formula", data, trace)
        )
        if key is not None:
            evicted = cache.put(key, recognized.latex, recognized.compact, recognized.confidence)
            if evicted:
                metrics.RECOGNITION_CACHE_EVICTIONS.labels(model).inc(evicted)
        body = RecognizeResponse(
            latex=recognized.latex,
            latex_compact=recognized.compact,
            confidence=recognized.confidence,
            model=model,
            batch_size=result.batch_size,
            timings_ms=trace.timings_ms,
        )
        return JSONResponse(body.model_dump())

    return await _handle(request, "/recognize", flow)


async def _cache_key(runtime: Runtime, cache: RecognitionCache, data: bytes, model: str) -> bytes:
    if len(data) <= HASH_INLINE_BYTES:
        return cache.key(data, model)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(runtime.pool, cache.key, data, model)


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={
        **ERRORS,
        200: {
            "description": "JSON; or the PNG itself with `Accept: image/png` and one image.",
            "content": {"image/png": {}},
        },
    },
    dependencies=[Depends(authorized)],
    summary="Generate images from a prompt",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": GenerateRequest.model_json_schema()}},
        }
    },
)
async def generate(request: Request) -> Response:
    """A text prompt in, images out. The same seed and parameters give the same image.

    With `Accept: text/event-stream`, server-sent events: `progress` while it waits and
    at every denoising step, then `image` (the JSON answer) or `error`."""

    async def flow(runtime: Runtime, model: str, trace: RequestTrace) -> Response:
        with trace.stage("http.parse"):
            body = await read_json(request, GenerateRequest)
            answer = preferred_type(request.headers.get("accept", ""), GENERATE_ANSWERS)
            wants_png = answer == "image/png"
            if wants_png and body.num_images != 1:
                raise ApiError(422, "invalid_parameter", "Accept: image/png needs num_images = 1")
        if answer == "text/event-stream":
            return await _progress_events(request, runtime, body, model, trace)
        images, result = await _generated(request, runtime, body, trace)
        pngs, seeds = images.pngs, images.seeds
        if wants_png:
            return Response(
                pngs[0],
                media_type="image/png",
                headers={
                    "X-Texel-Seed": str(seeds[0]),
                    "X-Texel-Batch-Size": str(result.batch_size),
                },
            )
        return JSONResponse(_generate_response(images, result, model, trace).model_dump())

    return await _handle(request, "/generate", flow)


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _progress_events(
    request: Request, runtime: Runtime, body: GenerateRequest, model: str, trace: RequestTrace
) -> StreamingResponse:
    """/generate as server-sent events. The request stages run first, so a request they
    refuse gets its error status as ever; once the stream has started, an error is an
    `error` event with the same body. A client that goes away ends the stream, and its
    work stops at the next step."""
    arrived = time.monotonic()
    job = await runtime.prepare("image", _image_request(body), trace)
    events: asyncio.Queue[bytes | None] = asyncio.Queue()

    def progress(steps: int, ahead: int | None) -> None:
        data = {"step": steps, "total": job.steps}
        if ahead is not None:
            data["queue_position"] = ahead
        events.put_nowait(_event("progress", data))

    async def stream():
        work = asyncio.ensure_future(runtime.complete("image", job, trace, arrived, progress))
        work.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                yield event
            try:
                images, result = work.result()
            except Exception as exc:
                error = to_api_error(exc)
                # On the span the request's trace was made under, its server span: the
                # stream runs wherever the ASGI server iterates it, and what is current
                # there is the server's business.
                _record_error(runtime, "/generate", exc, error, trace, trace.parent)
                yield _event("error", json.loads(error_response(error, request.url.path).body))
                return
            yield _event("image", _generate_response(images, result, model, trace).model_dump())
        finally:
            work.cancel()

    return StreamingResponse(
        stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


# -- OpenAI-compatible routes (app/openai_api.py translates) -----------------------------


@router.post(
    "/v1/images/generations",
    response_model=ImagesResponse,
    responses=OPENAI_ERRORS,
    dependencies=[Depends(authorized)],
    summary="Generate images from a prompt, as OpenAI's images API does",
    tags=["OpenAI-compatible"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": ImagesGenerationRequest.model_json_schema()}
            },
        }
    },
)
async def openai_images(request: Request) -> Response:
    """OpenAI's `images.generate`: `prompt`, `model`, `n`, `size` (`WxH`),
    `response_format` b64_json; Texel's `seed`, `steps`, `guidance_scale` and
    `negative_prompt` as extensions. Runs as /generate does."""

    async def flow(runtime: Runtime, model: str, trace: RequestTrace) -> Response:
        with trace.stage("http.parse"):
            body = await read_json(request, ImagesGenerationRequest)
            generate = openai_api.generate_request(body, model)
        try:
            images, _ = await _generated(request, runtime, generate, trace)
        except InputError as exc:  # the field at fault by OpenAI's name (`size`, `steps`)
            openai_api.name_in_openai_terms(exc)
            raise
        return JSONResponse(openai_api.images_response(images.pngs, images.seeds).model_dump())

    return await _handle(request, "/v1/images/generations", flow)


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses={401: OPENAI_ERRORS[401]},
    dependencies=[Depends(authorized)],
    summary="The served models, with their limits, as OpenAI lists models",
    tags=["OpenAI-compatible"],
)
async def openai_models(request: Request) -> JSONResponse:
    runtime = runtime_of(request)
    return JSONResponse(openai_api.model_list(runtime, request.app.state.started).model_dump())


@router.get(
    "/v1/models/{model:path}",  # a hub id's name holds a `/`
    response_model=ModelCard,
    responses={401: OPENAI_ERRORS[401], 404: OPENAI_ERRORS[404]},
    dependencies=[Depends(authorized)],
    summary="One served model, with its limits",
    tags=["OpenAI-compatible"],
)
async def openai_model(request: Request, model: str) -> JSONResponse:
    card = openai_api.find_model(runtime_of(request), model, request.app.state.started)
    return JSONResponse(card.model_dump())


@router.get("/livez", summary="The process is up")
async def livez() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Loading, failed or draining."}},
    summary="Models loaded and warmed up, not draining",
)
async def readyz(request: Request) -> JSONResponse:
    ready, draining, models = await runtime_of(request).readiness()
    body = Readiness(ready=ready, draining=draining, models=models)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get(
    "/debug/bottleneck",
    dependencies=[Depends(authorized)],
    summary="Sample CPU, GPU and stage times for a window and name the bottleneck",
)
async def bottleneck(
    request: Request,
    window_s: Annotated[float, Query(ge=0.5, le=120, description="Sampling window.")] = 10.0,
) -> dict:
    """Four-quadrant diagnosis: cpu_bound, gpu_bound, starved or saturated, with the numbers."""
    return await runtime_of(request).diagnose(window_s)


@router.get("/metrics", summary="Prometheus metrics (OpenMetrics when asked for)")
async def prometheus_metrics(request: Request) -> Response:
    payload, content_type = runtime_of(request).metrics_exposition(request.headers.get("accept"))
    return Response(payload, media_type=content_type)
