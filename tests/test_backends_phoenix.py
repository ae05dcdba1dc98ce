"""Texel's traces in a real OTLP backend: Arize Phoenix, read back over its REST API.

Phoenix (installed into its own venv by tests/backends/phoenix.sh) receives OTLP
over HTTP on a free port. A real Texel with tiny models exports to it with the
standard `OTEL_*` variables; the test sends requests under its own `traceparent`
and checks the stored spans: the caller's trace id, the server span as a child
of the caller's span, and the six stage spans as children of the server span.
Span links are not checked here (Phoenix drops them); tests/test_tracing.py
checks them with the SDK's in-memory exporter.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter

import httpx
import pytest

from tests.backends import BackgroundProcess, ensure_backend
from tests.conftest import formula_png, free_port
from tests.server import ServerProcess

STAGES = {"http.parse", "preprocess", "tokenize", "queue.wait", "generate", "postprocess"}
PROJECT = "default"  # where Phoenix files spans that name no project

# The first run installs Phoenix (about a minute and 850 MB).
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def phoenix_starting(tmp_path_factory):
    """Phoenix, started and not yet answering: it takes seconds of one core to start,
    as Texel does, so `texel` starts meanwhile and `phoenix` waits for both."""
    venv = ensure_backend("phoenix.sh")
    workdir = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env.update(
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(port),
        PHOENIX_GRPC_PORT=str(free_port()),
        PHOENIX_WORKING_DIR=str(workdir),
        PHOENIX_TELEMETRY_ENABLED="false",
        PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",
    )
    env.pop("PYTHONPATH", None)
    proc = BackgroundProcess([str(venv / "bin" / "phoenix"), "serve"], workdir / "phoenix.log", env)
    try:
        yield PhoenixApi(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def phoenix(phoenix_starting, texel):
    phoenix_starting.process.wait_http(phoenix_starting.url + "/healthz", timeout=180)
    return phoenix_starting


class PhoenixApi:
    def __init__(self, url: str, process: BackgroundProcess) -> None:
        self.url = url
        self.process = process

    def spans(self, **filters) -> list[dict]:
        response = httpx.get(
            f"{self.url}/v1/projects/{PROJECT}/spans",
            params={"limit": 1000, **filters},
            timeout=10,
        )
        if response.status_code == 404:  # the project appears with its first span
            return []
        response.raise_for_status()
        return response.json()["data"]

    def wait_for_trace(self, trace_id: str, names: set[str], timeout: float = 60) -> list[dict]:
        """The spans of `trace_id` once all of `names` have arrived."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id=trace_id)
            if names <= {s["name"] for s in spans}:
                return spans
            if time.monotonic() > deadline:
                got = sorted(s["name"] for s in spans)
                pytest.fail(
                    f"trace {trace_id} has {got}, wanted {sorted(names)}\n{self.process.log()}"
                )
            time.sleep(0.5)


@pytest.fixture(scope="module")
def texel(tiny_env, phoenix_starting):
    proc = ServerProcess(
        {
            **tiny_env,
            "OTEL_SERVICE_NAME": "texel-test",
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix_starting.url,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    yield proc
    proc.stop()


def traced_request(texel: ServerProcess, route: str) -> tuple[str, str]:
    """Send one request under a new caller span; return (trace id, caller span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    with texel.client(headers={"traceparent": f"00-{trace_id}-{span_id}-01"}) as client:
        if route == "/recognize":
            files = {"image": ("f.png", formula_png(), "image/png")}
            response = client.post(route, files=files)
        else:
            response = client.post(route, json={"prompt": "a red square", "seed": 3})
    assert response.status_code == 200, response.text
    return trace_id, span_id


@pytest.fixture(scope="module", params=["/recognize", "/generate"])
def stored_trace(request, texel, phoenix) -> tuple[str, str, list[dict]]:
    """(caller trace id, caller span id, the trace's spans as Phoenix lists them)."""
    trace_id, span_id = traced_request(texel, request.param)
    return trace_id, span_id, phoenix.wait_for_trace(trace_id, STAGES)


@pytest.fixture
def route(request) -> str:
    """The route of the current `stored_trace` parameter."""
    return request.node.callspec.params["stored_trace"]


def server_span(spans: list[dict], caller_span_id: str) -> dict:
    (span,) = [s for s in spans if s["parent_id"] == caller_span_id]
    return span


def test_spans_reach_phoenix_under_the_callers_trace_id(stored_trace):
    trace_id, _, spans = stored_trace
    assert spans
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}


def test_each_stage_span_appears_exactly_once(stored_trace):
    _, _, spans = stored_trace
    counts = Counter(s["name"] for s in spans)
    assert {stage: counts[stage] for stage in STAGES} == dict.fromkeys(STAGES, 1), counts


def test_texels_server_span_is_a_child_of_the_callers_span(stored_trace, route):
    _, caller_span_id, spans = stored_trace
    span = server_span(spans, caller_span_id)
    assert span["name"] == f"POST {route}"
    # Every other span of the request descends from it: nothing else hangs off the caller.
    own_ids = {s["context"]["span_id"] for s in spans}
    assert [s for s in spans if s["parent_id"] not in own_ids] == [span]


def test_stage_spans_are_children_of_the_server_span(stored_trace):
    _, caller_span_id, spans = stored_trace
    parent_id = server_span(spans, caller_span_id)["context"]["span_id"]
    for span in spans:
        if span["name"] in STAGES:
            assert span["parent_id"] == parent_id, (span["name"], span["parent_id"], parent_id)


def test_stage_spans_name_the_model_and_operation(stored_trace):
    _, _, spans = stored_trace
    for span in spans:
        if span["name"] in STAGES:
            attributes = span["attributes"]
            assert flat(attributes, "gen_ai.request.model"), (span["name"], attributes)
            assert flat(attributes, "gen_ai.operation.name"), (span["name"], attributes)


def test_the_batch_span_reaches_phoenix(stored_trace, phoenix):
    deadline = time.monotonic() + 30
    while not phoenix.spans(name="batch"):
        assert time.monotonic() < deadline, "no 'batch' span in Phoenix"
        time.sleep(0.5)


def flat(attributes: dict, dotted: str):
    """An attribute by its dotted name, whether Phoenix nests it or keeps it flat."""
    if dotted in attributes:
        return attributes[dotted]
    value = attributes
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value
