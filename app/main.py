"""The app factory: routes, middleware, error mapping and the lifespan, in one place."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from app.errors import install_error_handlers
from app.http import BodySizeLimit
from app.routes import router
from app.serving import Runtime
from app.settings import Settings
from engine import EngineClient
from models.base import Model
from telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)

UNTRACED_ROUTES = "livez,readyz,metrics"


def build_app(settings: Settings, models: dict[str, Model], engines: list[EngineClient]) -> FastAPI:
    """Assemble Texel: `models` are the request sides of the served models, `engines`
    where their payloads run. Models load in the engines once the server starts."""
    runtime = Runtime(settings, models, engines)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.drain()
            await runtime.close()
            shutdown_tracing()

    app = FastAPI(
        title="Texel",
        summary="Printed formulas to LaTeX, and prompts to images, batched on GPUs.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_upload_bytes=settings.max_upload_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "Accept", "traceparent", "tracestate"],
            expose_headers=["Retry-After", "X-Texel-Seed", "X-Texel-Batch-Size"],
            max_age=600,
        )
    max_batch = max(settings.formula.max_batch_size, settings.image.max_batch_size)
    if setup_tracing(max_batch_size=max_batch) is not None:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app, excluded_urls=UNTRACED_ROUTES, exclude_spans=["receive", "send"]
        )
    return app
