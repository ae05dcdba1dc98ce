"""Overload, deadlines, disconnects, readiness, shutdown, auth and CORS on real servers.

A server costs seconds of CPU to start, so tests whose settings agree share one: the two
deadline tests and a model that cannot load; API keys, CORS and JSON logs (the logs test,
last, stops it). Each test still sends its own requests and checks only its own
behaviour."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.launcher import shutdown_limit_s
from app.settings import Settings
from tests.conftest import formula_png, wait_for
from tests.fixtures import weightless_copy
from tests.server import ServerProcess

SLOW = {"prompt": "a slow one", "num_inference_steps": 40, "seed": 1}


@pytest.fixture(scope="module")
def deadlines(tiny_env, tmp_path_factory):
    """Requests have 2 s; one image at a time, of up to 1,000 steps. The formula model's
    folder has no weights: it fails to load, and the server is never ready."""
    missing = weightless_copy(
        Path(tiny_env["TEXEL_FORMULA__MODEL"]), tmp_path_factory.mktemp("models") / "weightless"
    )
    server = ServerProcess(
        {
            **tiny_env,
            "TEXEL_FORMULA__MODEL": str(missing),
            "TEXEL_REQUEST_TIMEOUT_S": "2",
            "TEXEL_IMAGE__MAX_STEPS": "1000",
            "TEXEL_IMAGE__MAX_BATCH_SIZE": "1",
        },
        wait_ready=False,
    )
    try:
        wait_for(lambda: httpx.get(server.url + "/readyz").json()["models"]["image"] == "ready")
        yield server
    finally:
        server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def guarded(tiny_env):
    """API keys, one browser origin and JSON logs; the formula model only."""
    server = ServerProcess(
        {
            **tiny_env,
            "TEXEL_API_KEYS": "k1,k2",
            "TEXEL_CORS_ORIGINS": "https://app.example",
            "TEXEL_LOG_FORMAT": "json",
            "TEXEL_IMAGE__ENABLED": "false",
        }
    )
    yield server
    server.stop(signal.SIGKILL)


def test_overload_gets_429_with_retry_after_and_every_accepted_request_succeeds(start_server):
    server = start_server(TEXEL_IMAGE__MAX_BATCH_SIZE="1", TEXEL_IMAGE__MAX_QUEUE="2")

    def post(i):
        with server.client() as client:
            return client.post("/generate", json={**SLOW, "seed": i})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(post, range(12)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 3  # one running plus a full queue of two
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
    assert server.metric("texel_requests_rejected_total", reason="queue_full") == statuses.count(
        429
    )


def test_a_request_that_cannot_finish_in_time_is_refused_before_it_runs(deadlines):
    """Its predicted time (the image model's speed, measured at warm-up) is past the
    deadline: 422 at once, and the device stays free for the next request."""
    server = deadlines
    with server.client() as client:
        started = time.monotonic()
        response = client.post(
            "/generate",
            json={"prompt": "never done", "num_inference_steps": 1000, "num_images": 4},
        )
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "invalid_parameter" and "longer than the 2 s" in error["message"]
        quick = client.post("/generate", json={"prompt": "quick", "num_inference_steps": 2})
        assert quick.status_code == 200
        assert time.monotonic() - started < 5


def test_an_admitted_request_that_runs_past_its_deadline_gets_504(deadlines):
    """(That its work then stops at the next step: tests/test_image_adapter.py.)"""
    server = deadlines
    with server.client() as client:
        # How long a step takes here, from what the server predicts for 4,000 of them.
        probe = client.post(
            "/generate", json={"prompt": "probe", "num_inference_steps": 1000, "num_images": 4}
        )
        predicted_s = float(re.search(r"about (\d+) s", probe.json()["error"]["message"])[1])
        steps = max(2, min(1000, int(1.3 * 4000 / predicted_s)))  # about 1.3 s: admitted

    def post(i):
        with server.client() as client:
            return client.post(
                "/generate", json={"prompt": f"slow {i}", "num_inference_steps": steps}
            )

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(post, range(4)))
    # One image at a time: the last of four waits for the others and runs past 2 s.
    codes = [r.status_code for r in responses]
    assert 504 in codes, codes
    late = next(r for r in responses if r.status_code == 504)
    assert late.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < 6  # answered at the deadline, not when done


def test_a_client_that_disconnects_frees_its_queue_slot(start_server):
    server = start_server(TEXEL_IMAGE__MAX_BATCH_SIZE="1", TEXEL_IMAGE__MAX_QUEUE="1")
    running = threading.Thread(
        target=lambda: httpx.post(
            server.url + "/generate", json={**SLOW, "num_inference_steps": 95}, timeout=120
        )
    )
    running.start()
    wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") >= 1)
    time.sleep(0.3)

    # A raw socket client queues a request, then hangs up.
    body = b'{"prompt": "impatient", "num_inference_steps": 40}'
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_for(lambda: server.metric("texel_queue_depth", model="image") == 1)
    with server.client() as client:
        full = client.post("/generate", json=SLOW)
        assert full.status_code == 429  # the queue of one is taken
    sock.close()
    wait_for(lambda: server.metric("texel_queue_depth", model="image") == 0)
    with server.client() as client:
        assert client.post("/generate", json={**SLOW, "num_inference_steps": 2}).status_code == 200
    running.join()
    # Counted once, as cancelled (by the batcher it waited in, not again by the route): a
    # client that gives up sent nothing invalid.
    assert server.metric("texel_requests_rejected_total", reason="cancelled") == 1
    assert server.metric("texel_requests_rejected_total", reason="invalid") == 0


def test_readyz_is_503_and_inference_503_when_a_model_cannot_load(deadlines):
    server = deadlines
    wait_for(lambda: httpx.get(server.url + "/readyz").json()["models"]["formula"] == "failed")
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503
    response = httpx.post(
        server.url + "/recognize", files={"image": ("f.png", formula_png(), "image/png")}
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_failed"
    assert httpx.get(server.url + "/livez").status_code == 200
    # An alert on `texel_model_ready == 0` fires for it; the image model beside it is up.
    text = httpx.get(server.url + "/metrics").text
    ready = dict(re.findall(r'^texel_model_ready\{model="([^"]+)"\} (\S+)$', text, re.M))
    assert sorted(ready.values()) == ["0.0", "1.0"], ready
    # The log says why in one line, the folder that lacks its weights named: a missing
    # file is the user's to fix, not a bug to trace.
    log = server.log(tail=1_000_000)
    failures = [line for line in log.splitlines() if "model" in line and "ERROR" in line]
    assert failures and all("/weightless" in line for line in failures), failures
    assert "Traceback" not in log


# A server of its own: it stops it, and the default queue takes all three requests
# whatever order they reach it in.
def test_sigterm_drops_readiness_and_lets_in_flight_requests_finish(start_server):
    server = start_server(TEXEL_SHUTDOWN_GRACE_S="1.5", TEXEL_IMAGE__MAX_BATCH_SIZE="1")

    def post(i):
        with server.client() as client:
            return client.post("/generate", json={**SLOW, "seed": i})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post, i) for i in range(3)]
        wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") >= 3)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        late = httpx.post(server.url + "/generate", json=SLOW)
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert server.metric("texel_requests_rejected_total", reason="draining") == 1
        assert [f.result().status_code for f in futures] == [200, 200, 200]
    # uvicorn re-raises the signal once shut down cleanly, as a process killed by it would.
    assert server.process.wait(60) in (0, -signal.SIGTERM)
    assert "draining" in server.log()


def test_requests_still_running_when_the_drain_times_out_are_answered_503(start_server):
    server = start_server(
        TEXEL_DRAIN_TIMEOUT_S="1",
        TEXEL_REQUEST_TIMEOUT_S="600",  # a busy machine's estimate refuses none (422)
        TEXEL_IMAGE__MAX_STEPS="1000",
        TEXEL_IMAGE__MAX_BATCH_SIZE="1",
    )
    settings = Settings(shutdown_grace_s=0, drain_timeout_s=1)
    long = {"prompt": "a long one", "num_inference_steps": 1000}  # seconds, not one

    def post(i):
        with server.client() as client:
            return client.post("/generate", json={**long, "seed": i})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(post, i) for i in range(2)]  # one running, one queued
        wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") >= 2)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        responses = [f.result() for f in futures]
    # Each gets Texel's JSON 503, not a dropped connection or uvicorn's plain-text 500.
    assert [r.status_code for r in responses] == [503, 503]
    assert {r.json()["error"]["code"] for r in responses} == {"draining"}
    assert server.process.wait(shutdown_limit_s(settings)) in (0, -signal.SIGTERM)
    assert time.monotonic() - signalled < shutdown_limit_s(settings)
    assert "Traceback" not in server.log()


def test_api_keys_guard_inference_but_not_health_or_metrics(guarded):
    server = guarded
    files = {"image": ("f.png", formula_png(), "image/png")}
    with server.client() as client:
        assert client.post("/recognize", files=files).status_code == 401
        wrong = client.post("/recognize", files=files, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.headers["www-authenticate"] == "Bearer"
        ok = client.post("/recognize", files=files, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        for path in ("/livez", "/readyz", "/metrics"):
            assert client.get(path).status_code == 200


def test_cors_lets_configured_origins_call_the_api(guarded):
    server = guarded
    with server.client() as client:
        preflight = client.options(
            "/generate",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,authorization",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options(
            "/generate",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in other.headers


# Last on its server: it stops it, to read the whole log.
def test_json_logs_are_one_object_a_line_with_the_request_trace_id(guarded):
    import json

    server = guarded
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    with server.client() as client:
        response = client.post(
            "/recognize",
            files={"image": ("f.png", formula_png(), "image/png")},
            headers={
                "traceparent": f"00-{trace_id}-b7ad6b7169203331-01",
                "Authorization": "Bearer k1",
            },
        )
    assert response.status_code == 200
    server.stop()
    entries = [json.loads(line) for line in server.log(tail=10**7).splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
    access = [e for e in entries if "POST /recognize" in e["message"]]
    # Its own request is the last to /recognize (the API key test's came before).
    assert access and access[-1]["trace_id"] == trace_id and len(access[-1]["span_id"]) == 16


def test_a_formulas_answer_does_not_queue_behind_preprocessing_in_the_http_process(tiny_models):
    """Detokenizing takes microseconds: a read formula is answered while the HTTP
    process's preprocessing thread is still busy with other work."""
    from app.launcher import single_process_app
    from app.settings import Settings
    from tests.server import serving_in_thread

    settings = Settings(
        device="cpu",
        formula={"model": str(tiny_models["formula"]), "cache_mb": 0},
        image={"enabled": False, "model": str(tiny_models["image"])},
        advanced={"preprocess_threads": 1},
    )
    app = single_process_app(settings)
    busy = threading.Event()
    with serving_in_thread(app) as url:
        runtime = app.state.runtime
        model = runtime.models["formula"]
        preprocess = model.preprocess

        def preprocess_then_occupy_the_thread(data: bytes):
            payload = preprocess(data)
            runtime.pool.submit(busy.wait, 30)  # runs on the one thread once this returns
            return payload

        model.preprocess = preprocess_then_occupy_the_thread
        try:
            started = time.monotonic()
            files = {"image": ("f.png", formula_png(), "image/png")}
            response = httpx.post(url + "/recognize", files=files, timeout=60)
            took = time.monotonic() - started
        finally:
            busy.set()
            model.preprocess = preprocess
    assert response.status_code == 200, response.text
    assert took < 20, f"answered after {took:.1f} s: behind the busy thread"


def test_a_small_png_is_preprocessed_on_the_event_loop_and_larger_pictures_on_the_pool(
    tiny_models,
):
    """A picture of a few thousand pixels costs less to preprocess than handing it to the
    thread pool and back; a large one, or one whose size the upload does not say (JPEG),
    must not hold the event loop, so it goes to the pool. Both answer alike."""
    from app.launcher import single_process_app
    from app.settings import Settings
    from models.formula.adapter import QUICK_PIXELS
    from tests.server import serving_in_thread

    settings = Settings(
        device="cpu",
        formula={"model": str(tiny_models["formula"]), "cache_mb": 0},
        image={"enabled": False, "model": str(tiny_models["image"])},
    )
    app = single_process_app(settings)
    large = (1000, QUICK_PIXELS // 1000 + 1)
    uploads = {
        "small png": formula_png(),
        "large png": formula_png(size=large),
        "small jpeg": formula_png(fmt="JPEG"),
    }
    threads: dict[str, str] = {}
    answers: dict[str, str] = {}
    with serving_in_thread(app) as url:
        model = app.state.runtime.models["formula"]
        preprocess = model.preprocess
        for name, data in uploads.items():

            def recorded(upload: bytes, name=name):
                threads[name] = threading.current_thread().name
                return preprocess(upload)

            model.preprocess = recorded
            try:
                files = {"image": ("f", data, "image/png")}
                response = httpx.post(url + "/recognize", files=files, timeout=60)
            finally:
                model.preprocess = preprocess
            assert response.status_code == 200, response.text
            answers[name] = response.json()["latex"]
        # The same small picture through the pool reads the same.
        model.quick_request = lambda request: False
        try:
            files = {"image": ("f", uploads["small png"], "image/png")}
            pooled = httpx.post(url + "/recognize", files=files, timeout=60).json()["latex"]
        finally:
            del model.quick_request
    assert not threads["small png"].startswith("texel-http"), threads
    assert threads["large png"].startswith("texel-http"), threads
    assert threads["small jpeg"].startswith("texel-http"), threads
    assert pooled == answers["small png"]
