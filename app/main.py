"""The app factory: routes, middleware, error mapping and the lifespan, in one place."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from app.errors import install_error_handlers
from app.http import BodySizeLimit, NoSniff
from app.routes import router
from app.serving import Runtime
from app.settings import Settings
from engine import EngineClient
from models.base import Model
from telemetry import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)

UNTRACED_ROUTES = "livez,readyz,metrics,static/"
# The page at `/` and the assets it and `/docs` load: shipped in the package, so both
# work offline. URLs are relative, so they also work behind a path prefix.
STATIC = Path(__file__).resolve().parent / "static"
SWAGGER_UI = "static/vendor/swagger-ui"
# The page keeps an API key in its origin's storage and shows LaTeX that a picture can
# make the model write: it runs only its own scripts (none inline), and no other site
# frames it. KaTeX styles its output inline; generated images are blob: URLs.
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' blob: data:; font-src 'self'; connect-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# Swagger UI starts from an inline script: the reference is kept from frames only.
DOCS_POLICY = "frame-ancestors 'none'"


async def page(request: Request) -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_POLICY})


async def swagger_ui(request: Request) -> HTMLResponse:
    response = get_swagger_ui_html(
        openapi_url="openapi.json",
        title="Texel - API reference",
        swagger_js_url=f"{SWAGGER_UI}/swagger-ui-bundle.js",
        swagger_css_url=f"{SWAGGER_UI}/swagger-ui.css",
        swagger_favicon_url="static/favicon.svg",
    )
    response.headers["Content-Security-Policy"] = DOCS_POLICY
    return response


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
        docs_url=None,  # served below from the package's own Swagger UI, not a CDN
        redoc_url=None,
        redirect_slashes=False,  # a trailing slash gets a 404 that names the route
    )
    app.state.runtime = runtime
    app.include_router(router)
    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", swagger_ui, methods=["GET"], include_in_schema=False)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_upload_bytes=settings.max_upload_bytes)
    if settings.cors_origins:
        # Any request header: clients add their own (OpenAI's JavaScript client sends
        # X-Stainless-* headers, a set that changes between its versions), and the
        # origins, not the headers, are what keeps other pages out.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "X-Texel-Seed", "X-Texel-Batch-Size"],
            max_age=600,
        )
    app.add_middleware(NoSniff)  # outermost: on every answer, refusals and preflights too
    # A batch span links its requests; an unset batch size defaults to at most 128,
    # which setup_tracing allows anyway.
    max_batch = max((e.max_batch_size or 0 for e in settings.models().values()), default=0)
    if setup_tracing(max_batch_size=max_batch) is not None:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app, excluded_urls=UNTRACED_ROUTES, exclude_spans=["receive", "send"]
        )
    return app
