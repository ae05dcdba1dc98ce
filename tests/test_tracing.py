"""Stage spans and batch links, from a real server running in this process.

The server (one process on a CPU: the engine inside it) runs on a socket in a
background thread so the SDK's in-memory exporter sees every span it makes.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from app.launcher import single_process_app
from app.settings import Settings
from telemetry import add_span_processor
from tests.conftest import ROOT, formula_png, wait_for
from tests.server import serving_in_thread

STAGES = ["http.parse", "preprocess", "queue.wait", "generate", "tokenize", "postprocess"]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced_server(tiny_models):
    exporter = InMemorySpanExporter()
    settings = Settings(
        device="cpu",
        # Every request computed, none answered from the recognition cache: these tests
        # follow the spans of the stages and batches it would skip.
        formula={
            "model": str(tiny_models["formula"]),
            "max_wait_ms": 200,
            "max_batch_size": 4,
            "cache_mb": 0,
        },
        image={"enabled": False, "model": str(tiny_models["image"])},
    )
    app = single_process_app(settings)
    add_span_processor(SimpleSpanProcessor(exporter))
    with serving_in_thread(app) as url:
        yield url, exporter


def recognize(url: str, headers=None) -> httpx.Response:
    files = {"image": ("f.png", formula_png(), "image/png")}
    return httpx.post(url + "/recognize", files=files, headers=headers or {}, timeout=60)


def test_each_request_has_its_stage_spans_under_the_callers_trace(traced_server):
    url, exporter = traced_server
    exporter.clear()
    traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    response = recognize(url, {"traceparent": traceparent})
    assert response.status_code == 200
    spans = [
        s
        for s in exporter.get_finished_spans()
        if format(s.context.trace_id, "032x") == CALLER_TRACE
    ]
    names = [s.name for s in spans]
    for stage in STAGES:
        assert names.count(stage) == 1, names
    server_span = next(
        s for s in spans if s.parent is not None and format(s.parent.span_id, "016x") == CALLER_SPAN
    )
    for span in spans:
        if span.name in STAGES:
            assert span.parent.span_id == server_span.context.span_id, span.name
            assert span.attributes["gen_ai.request.model"] == "formula"
    tokenize = next(s for s in spans if s.name == "tokenize")
    assert tokenize.attributes["texel.confidence"] == round(response.json()["confidence"], 4)


def test_a_batch_span_links_every_member_and_each_generate_links_back(traced_server):
    url, exporter = traced_server
    exporter.clear()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: recognize(url), range(4)))
    assert max(r.json()["batch_size"] for r in responses) > 1
    spans = exporter.get_finished_spans()
    batches = [s for s in spans if s.name == "batch"]
    assert any(s.attributes["texel.batch.size"] > 1 for s in batches)
    traced = set()
    for batch in batches:
        members = {link.context.trace_id for link in batch.links}
        # Rows that joined a running stream get a span of their own, linking just them.
        joined = batch.attributes.get("texel.batch.joined", batch.attributes["texel.batch.size"])
        assert len(members) == joined
        generates = [s for s in spans if s.name == "generate" and s.context.trace_id in members]
        assert len(generates) == len(members)
        for span in generates:
            assert [link.context.span_id for link in span.links] == [batch.context.span_id]
        traced |= members
    assert len(traced) == 4, "every request is linked from the batch it ran in"


def test_untraced_routes_make_no_spans(traced_server):
    url, exporter = traced_server
    for path in ("/livez", "/readyz", "/metrics"):
        httpx.get(url + path)
    time.sleep(0.2)
    paths = {
        str(
            s.attributes.get("http.route")
            or s.attributes.get("url.path")
            or s.attributes.get("http.target")
        )
        for s in exporter.get_finished_spans()
    }
    assert "/recognize" in paths  # server spans do carry their route
    assert not paths & {"/livez", "/readyz", "/metrics"}, paths


def test_a_refused_request_says_why_on_its_span(traced_server):
    """An operator finds a failed request in the trace backend by its error code."""
    url, exporter = traced_server
    exporter.clear()
    files = {"image": ("f.png", b"not a picture", "image/png")}
    response = httpx.post(
        url + "/recognize",
        files=files,
        headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
        timeout=60,
    )
    assert response.status_code == 415
    server_span = next(
        s
        for s in exporter.get_finished_spans()
        if s.parent is not None and format(s.parent.span_id, "016x") == CALLER_SPAN
    )
    assert server_span.attributes["texel.error.code"] == "unsupported_image"


def test_the_time_a_request_spent_in_the_engine_for_nothing_is_a_span_with_the_reason(
    tiny_models,
):
    """A client gives up on a long image: its time in the engine is in the trace as an
    `engine` span marked with why no answer came, not missing."""
    exporter = InMemorySpanExporter()
    settings = Settings(
        device="cpu",
        formula={"enabled": False, "model": str(tiny_models["formula"])},
        image={"model": str(tiny_models["image"]), "max_steps": 1000},
        request_timeout_s=600,  # a busy machine's estimate refuses none (422)
    )
    add_span_processor(SimpleSpanProcessor(exporter))
    body = {"prompt": "a long one", "num_inference_steps": 1000}
    headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    with serving_in_thread(single_process_app(settings)) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/generate", json=body, headers=headers, timeout=1.0)

        def traced() -> list:
            return [
                s
                for s in exporter.get_finished_spans()
                if format(s.context.trace_id, "032x") == CALLER_TRACE
            ]

        wait_for(lambda: any(s.name == "engine" for s in traced()))
        wait_for(
            lambda: any(s.parent and s.parent.span_id == int(CALLER_SPAN, 16) for s in traced())
        )
    spans = traced()
    server_span = next(
        s for s in spans if s.parent is not None and format(s.parent.span_id, "016x") == CALLER_SPAN
    )
    assert server_span.attributes["texel.error.code"] == "client_closed_request"
    (engine,) = [s for s in spans if s.name == "engine"]
    assert engine.parent.span_id == server_span.context.span_id
    assert engine.attributes["error.type"] == "cancelled"
    assert engine.status.status_code == StatusCode.ERROR
    assert 0.3 < (engine.end_time - engine.start_time) / 1e9 < 10
    assert not {"queue.wait", "generate"} & {s.name for s in spans}


SILENT_BACKEND_EXIT = """
import time
from opentelemetry import trace
from telemetry.tracing import FLUSH_S, setup_tracing, shutdown_tracing

setup_tracing()
with trace.get_tracer("texel-test").start_as_current_span("a request"):
    pass
started = time.monotonic()
shutdown_tracing()
print(time.monotonic() - started, FLUSH_S)
"""


def test_a_trace_backend_that_never_answers_holds_an_exit_no_longer_than_the_flush_bound():
    """It held each process's exit for about 20 s (the exporter's timeout and retries),
    past the launcher's limit for a drain."""
    with socket.socket() as silent:  # takes connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SDK_DISABLED": ""}
        done = subprocess.run(
            [sys.executable, "-c", SILENT_BACKEND_EXIT],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    waited_s, bound_s = map(float, done.stdout.split())
    assert waited_s < bound_s + 1.0, done.stdout
    assert "the trace backend did not take the last spans" in done.stderr
