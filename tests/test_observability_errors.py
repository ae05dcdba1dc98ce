"""What the metrics and spans say of requests that do not end as a plain JSON answer: a
streamed /generate, an error once its stream has started, a body refused by its head
before any route runs, and errors answered by the framework's handlers
(docs/observability.md)."""

from __future__ import annotations

import json
import socket

import httpx
import psutil
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.http import MULTIPART_OVERHEAD  # the largest body of any route but /recognize
from app.launcher import single_process_app
from app.settings import Settings
from telemetry import add_span_processor
from tests.conftest import formula_png, wait_for
from tests.server import otlp_sink, serving_in_thread

PROMPT = {"prompt": "a red circle on a blue background", "seed": 5}
CALLER_SPAN = "00f067aa0ba902b7"
API_KEY = "observed"
UPLOAD_LIMIT = 32 * 1024  # a raw image's body may be this large, no larger


def traceparent(trace_id: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{CALLER_SPAN}-01"}


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def open_stream(port: int, steps: int, headers: dict[str, str] | None = None) -> socket.socket:
    """A /generate request for server-sent events on a socket of its own, read until its
    generation has made its first step."""
    body = json.dumps({**PROMPT, "num_inference_steps": steps}).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Accept: text/event-stream\r\nConnection: close\r\n"
        + f"{head}Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while b'"step":1,' not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended early: {seen!r}"
        seen += chunk
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """The rest of a stream, until the server closes the connection."""
    rest = b""
    with sock:
        while chunk := sock.recv(65536):
            rest += chunk
    return rest


# -- a streamed /generate is in flight until its stream ends ---------------------------


def test_a_streamed_generation_is_in_flight_until_its_last_event(server):
    sock = open_stream(server.port, steps=60)
    assert server.metric("texel_inflight_requests", route="/generate") == 1
    assert b"event: image" in read_to_end(sock)
    wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") == 0)


def test_a_stream_whose_client_leaves_is_in_flight_until_it_has_gone(server):
    sock = open_stream(server.port, steps=100)
    assert server.metric("texel_inflight_requests", route="/generate") == 1
    sock.close()
    wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") == 0)


# -- an error once the stream has started ----------------------------------------------


def engine_of(server) -> psutil.Process:
    """The launcher's engine process."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    return next(child for child in children if child.name() == "texel-cpu")


def test_an_error_event_is_counted_and_on_the_server_span_as_the_same_error_as_json(
    start_server,
):
    """The engine dies while the image is being made: the client gets an `error` event
    (the stream had started), counted as the same 503 in JSON is, once."""
    spans: list = []
    sink = otlp_sink(
        lambda request: spans.extend(
            span
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        )
    )
    server = start_server(
        TEXEL_HTTP_PROCESSES="2",
        TEXEL_FORMULA__ENABLED="false",
        OTEL_EXPORTER_OTLP_ENDPOINT=sink,
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    engine = engine_of(server)
    rejected = server.metric("texel_requests_rejected_total", model="image")
    unavailable = server.metric("texel_requests_rejected_total", reason="unavailable")
    trace_id = "5eedc0ffee5eedc0ffee5eedc0ffee00"
    sock = open_stream(server.port, steps=100, headers=traceparent(trace_id))
    engine.kill()
    rest = read_to_end(sock)
    assert b"event: error" in rest and b'"code":"engine_unavailable"' in rest, rest
    assert server.metric("texel_requests_rejected_total", model="image") == rejected + 1
    assert server.metric("texel_requests_rejected_total", reason="unavailable") == unavailable + 1
    wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") == 0)

    def server_span():
        return next(
            (
                span
                for span in list(spans)
                if span.trace_id.hex() == trace_id and span.parent_span_id.hex() == CALLER_SPAN
            ),
            None,
        )

    wait_for(lambda: server_span() is not None, timeout=10)
    attributes = {a.key: a.value.string_value for a in server_span().attributes}
    assert attributes["texel.error.code"] == "engine_unavailable"


# -- refusals answered before a route runs, or by the framework's handlers -------------


@pytest.fixture(scope="module")
def traced(tiny_models):
    """A one-process server with the formula model, an API key and a small upload limit,
    whose spans this process sees: its URL and the exporter holding them."""
    exporter = InMemorySpanExporter()
    settings = Settings(
        device="cpu",
        formula={"model": str(tiny_models["formula"]), "cache_mb": 0},
        image={"enabled": False, "model": str(tiny_models["image"])},
        api_keys=[API_KEY],
        max_upload_bytes=UPLOAD_LIMIT,
    )
    app = single_process_app(settings)
    add_span_processor(SimpleSpanProcessor(exporter))
    with serving_in_thread(app) as url:
        yield url, exporter


def server_span_code(exporter: InMemorySpanExporter, trace_id: str) -> str | None:
    """The `texel.error.code` of the server span of the request sent with `trace_id`."""

    def found():
        return next(
            (
                span
                for span in exporter.get_finished_spans()
                if format(span.context.trace_id, "032x") == trace_id
                and span.parent is not None
                and format(span.parent.span_id, "016x") == CALLER_SPAN
            ),
            None,
        )

    wait_for(lambda: found() is not None, timeout=10)  # it ends just after its answer
    return found().attributes.get("texel.error.code")


def post_image(url: str, content, trace_id: str, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Content-Type": "image/png", **traceparent(trace_id)}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url + "/recognize", content=content, headers=headers, timeout=60)


def test_a_body_refused_by_its_length_is_counted_and_on_its_span_as_a_chunked_one_is(traced):
    url, exporter = traced
    too_large = formula_png() + bytes(UPLOAD_LIMIT)

    def chunked():
        for start in range(0, len(too_large), 8192):
            yield too_large[start : start + 8192]

    for trace_id, content in (
        ("1ead1e4c7b0d1e5000000000000000a1", too_large),  # with its Content-Length
        ("c4a2ced0b0d1e50000000000000000a2", chunked()),
    ):
        invalid = metric(url, "texel_requests_rejected_total", model="formula", reason="invalid")
        response = post_image(url, content, trace_id)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"
        assert server_span_code(exporter, trace_id) == "payload_too_large"
        after = metric(url, "texel_requests_rejected_total", model="formula", reason="invalid")
        assert after == invalid + 1


def test_a_body_refused_by_its_length_is_not_counted_where_no_route_would_have_read_it(
    traced,
):
    """Without an API key the same body gets 401 when chunked, on a path of no model 404:
    not counted either. The span says why it was refused."""
    url, exporter = traced
    too_large = formula_png() + bytes(UPLOAD_LIMIT)
    rejected = metric(url, "texel_requests_rejected_total")
    trace_id = "00a0e1c000000000000000000000b001"
    assert post_image(url, too_large, trace_id, key=None).status_code == 413
    assert server_span_code(exporter, trace_id) == "payload_too_large"
    trace_id = "00a0e1c000000000000000000000b002"
    elsewhere = httpx.post(
        url + "/nowhere", content=bytes(MULTIPART_OVERHEAD + 1), headers=traceparent(trace_id)
    )
    assert elsewhere.status_code == 413
    assert server_span_code(exporter, trace_id) == "payload_too_large"
    assert metric(url, "texel_requests_rejected_total") == rejected


@pytest.mark.parametrize(
    ("method", "path", "authorized", "status", "code"),
    [
        ("POST", "/recognize", False, 401, "unauthorized"),
        ("GET", "/nowhere", True, 404, "not_found"),
        ("GET", "/recognize", True, 405, "method_not_allowed"),
        ("GET", "/debug/bottleneck?window_s=0", True, 422, "invalid_parameter"),
    ],
)
def test_an_error_the_frameworks_handlers_answer_is_on_the_server_span(
    traced, method, path, authorized, status, code
):
    url, exporter = traced
    trace_id = f"{status:032d}"
    headers = traceparent(trace_id)
    if authorized:
        headers["Authorization"] = f"Bearer {API_KEY}"
    response = httpx.request(method, url + path, headers=headers, timeout=30)
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert server_span_code(exporter, trace_id) == code
