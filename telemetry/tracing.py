"""OpenTelemetry set-up and the per-request stage recorder.

Tracing is configured only through the standard `OTEL_*` variables. With no
endpoint set there is no exporter; spans still carry ids for log correlation
and metric exemplars. Code elsewhere uses `RequestTrace` and `BatchTelemetry`,
never the SDK directly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanProcessor
from opentelemetry.trace import Link, Span, SpanContext, Status, StatusCode

from telemetry import metrics

log = logging.getLogger(__name__)

_tracer = trace.get_tracer("texel")
_provider: TracerProvider | None = None
FLUSH_S = 3.0  # the longest a process's exit waits for its last spans to be exported


def setup_tracing(max_batch_size: int = 128) -> TracerProvider | None:
    """Install Texel's tracer provider once per process, from the `OTEL_*` variables.

    The SDK's link limit is raised to the largest batch, since a batch span
    links every member request. Returns None when `OTEL_SDK_DISABLED=true`.
    """
    global _provider
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if _provider is not None:
        return _provider
    os.environ.setdefault("OTEL_SERVICE_NAME", "texel")
    # Current HTTP semantic conventions (http.request.method, url.path, ...).
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    limits = SpanLimits(max_links=max(128, max_batch_size))
    # Shut down by `shutdown_tracing`, within a bound, not at exit without one.
    provider = TracerProvider(
        resource=Resource.create(), span_limits=limits, shutdown_on_exit=False
    )
    exporter = _exporter_from_env()
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def add_span_processor(processor: SpanProcessor) -> None:
    """Attach another processor (tests use an in-memory exporter)."""
    provider = setup_tracing()
    if provider is not None:
        provider.add_span_processor(processor)


def shutdown_tracing(timeout_s: float = FLUSH_S) -> None:
    """Export the spans not yet sent, waiting at most `timeout_s`: a trace backend that
    does not answer held each process's exit for about 20 s (the exporter's timeout and
    retries; the SDK's flush does not keep to the time it is given), past the launcher's
    limit for a drain. Spans still unsent then are dropped, and the log says so."""
    if _provider is None:
        return
    # A flush, not a shutdown: an in-process server (tests, `texel recognize`) may start
    # again in the same process, with the same provider.
    flushing = threading.Thread(target=_provider.force_flush, name="texel-trace-flush", daemon=True)
    flushing.start()
    flushing.join(timeout_s)
    if flushing.is_alive():
        log.warning(
            "the trace backend did not take the last spans within %.0f s; they are dropped",
            timeout_s,
        )


def _exporter_from_env():
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return None
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
    )
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP gRPC exporter not installed; falling back to http/protobuf")
        else:
            return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def current_trace_id() -> str | None:
    """Hex trace id of the current span if it is sampled (for exemplars and logs)."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return format(ctx.trace_id, "032x")


def _exemplar(trace_id: str | None) -> dict[str, str] | None:
    return {"trace_id": trace_id} if trace_id else None


@functools.cache
def _stage_histogram(model: str, stage: str):
    """The labelled child of the stage histogram, looked up once (labels() locks)."""
    return metrics.STAGE_DURATION.labels(model, stage)


@functools.cache
def _queue_wait_histogram(model: str):
    return metrics.QUEUE_WAIT.labels(model)


class RequestTrace:
    """Times the stages of one request as spans, histogram samples and `timings_ms`."""

    def __init__(self, model: str, operation: str) -> None:
        self.model = model
        self.operation = operation
        self.timings_ms: dict[str, float] = {}
        # Handed to an engine: its batcher counts the request if it goes unanswered
        # (`texel_requests_rejected_total`), so the route does not count it again.
        self.in_engine = False
        self.parent: Span = trace.get_current_span()
        self.trace_id = current_trace_id()
        self._exemplar = _exemplar(self.trace_id)
        self._constant_attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "texel.model": model,
        }

    @property
    def span_context(self) -> SpanContext:
        """The request's span context; a batch span links to it."""
        return self.parent.get_span_context()

    @contextlib.contextmanager
    def stage(self, name: str, **attributes: Any) -> Iterator[Span]:
        """Run a block as stage `name`: one span, one histogram sample, one timing."""
        started = time.perf_counter()
        with _tracer.start_as_current_span(
            name, attributes=self._attributes(attributes), record_exception=False
        ) as span:
            try:
                yield span
            except Exception as exc:
                span.set_attribute("error.type", type(exc).__name__)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                raise
            finally:
                self._observe(name, time.perf_counter() - started)

    def record(
        self,
        name: str,
        start_ns: int,
        duration_s: float,
        links: list[Link] | None = None,
        **attributes: Any,
    ) -> None:
        """Record a stage that happened elsewhere (in the batcher) after the fact."""
        ctx = trace.set_span_in_context(self.parent)
        span = _tracer.start_span(
            name,
            context=ctx,
            start_time=start_ns,
            attributes=self._attributes(attributes),
            links=links,
        )
        span.end(end_time=start_ns + int(duration_s * 1e9))
        self._observe(name, duration_s)

    def unanswered(self, start_ns: int, reason: str) -> None:
        """The time since `start_ns` in an engine that gave the request no result (a full
        queue, a deadline, a client gone, a failed batch): an `engine` span with the
        reason as `error.type`. No histogram sample: a refusal's wait is no stage's speed."""
        span = _tracer.start_span(
            "engine",
            context=trace.set_span_in_context(self.parent),
            start_time=start_ns,
            attributes=self._attributes({"error.type": reason}),
        )
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    def _observe(self, name: str, seconds: float) -> None:
        self.timings_ms[name] = round(self.timings_ms.get(name, 0.0) + seconds * 1000, 3)
        _stage_histogram(self.model, name).observe(seconds, exemplar=self._exemplar)
        if name == "queue.wait":
            _queue_wait_histogram(self.model).observe(seconds, self._exemplar)

    def _attributes(self, extra: dict[str, Any]) -> dict[str, Any]:
        if not extra:
            return self._constant_attributes
        attributes = dict(self._constant_attributes)
        attributes.update({k: v for k, v in extra.items() if v is not None})
        return attributes


class BatchTelemetry:
    """The batcher's observer: a `batch` span linking its members, plus batch metrics.

    `padding_efficiency` maps a batch's payloads to real/padded elements. `device_s`
    reads the model's device time so far on this device (`engine.sharing.DeviceMeter`):
    each batch span gets the device time spent while it ran, `texel.device.seconds`
    (for requests that joined a running stream, shared with every row beside them), and
    `attributes` say where its work queued (`texel.device.stream`).
    """

    def __init__(
        self,
        model: str,
        operation: str,
        padding_efficiency: Callable[[list[Any]], float | None] | None = None,
        device_s: Callable[[], float] | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.operation = operation
        self._padding_efficiency = padding_efficiency
        self._device_s = device_s
        self._extra = attributes or {}

    @contextlib.contextmanager
    def batch(self, batcher: str, worker: str, bucket: Hashable, items: list[Any]):
        span = self._start(worker, bucket, items, len(items))
        before = self._device_seconds()
        with trace.use_span(span, end_on_exit=True):
            try:
                yield span.get_span_context()
            finally:
                self._set_device_seconds(span, before)

    def join(
        self, batcher: str, worker: str, bucket: Hashable, items: list[Any], running: int
    ) -> tuple[tuple[Span, float | None], SpanContext]:
        """Requests joined a running decode (continuous batching): a batch span of their
        own, `texel.batch.size` the rows decoding together once they joined; it ends when
        the last of them has its answer (`leave`)."""
        span = self._start(worker, bucket, items, running, joined=len(items))
        return (span, self._device_seconds()), span.get_span_context()

    def leave(self, handle: tuple[Span, float | None] | None) -> None:
        if handle is not None:
            span, before = handle
            self._set_device_seconds(span, before)
            span.end()

    def _device_seconds(self) -> float | None:
        return None if self._device_s is None else self._device_s()

    def _set_device_seconds(self, span: Span, before: float | None) -> None:
        if before is not None:
            span.set_attribute("texel.device.seconds", round(self._device_s() - before, 6))

    def _start(
        self, worker: str, bucket: Hashable, items: list[Any], size: int, joined: int | None = None
    ) -> Span:
        """A batch span (and its batch-size and padding metrics)."""
        links = [
            Link(item.context)
            for item in items
            if isinstance(item.context, SpanContext) and item.context.is_valid
        ]
        attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": self.model,
            "texel.model": self.model,
            "texel.batch.size": size,
            "texel.batch.bucket": str(bucket),
            "texel.device": worker,
            **self._extra,
        }
        if joined is not None:
            attributes["texel.batch.joined"] = joined
        efficiency = None
        if self._padding_efficiency is not None:
            efficiency = self._padding_efficiency([item.payload for item in items])
            if efficiency is not None:
                attributes["texel.batch.padding_efficiency"] = round(efficiency, 4)
        metrics.BATCH_SIZE.labels(self.model).observe(size)
        if efficiency is not None:
            metrics.PADDING_EFFICIENCY.labels(self.model).observe(efficiency)
        # A batch serves many traces: it starts a trace of its own and links them all.
        return _tracer.start_span(
            "batch", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
            attributes=attributes,
        )  # fmt: skip

    def queue_depth(self, batcher: str, depth: int) -> None:
        metrics.QUEUE_DEPTH.labels(self.model).set(depth)

    def rejected(self, batcher: str, reason: str) -> None:
        metrics.REJECTED.labels(self.model, reason).inc()
