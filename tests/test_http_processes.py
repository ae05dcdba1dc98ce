"""Several HTTP processes on one port (TEXEL_HTTP_PROCESSES), and the channel between them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from app.channel import Channel, ChannelClosed
from app.errors import ApiError
from batching import QueueFull
from tests.conftest import formula_png, wait_for
from tests.server import otlp_sink

SLOW = {"prompt": "a slow one", "num_inference_steps": 40, "seed": 1}


def _http_children(server) -> list[psutil.Process]:
    """The extra HTTP processes: spawned children of the serving process."""
    children = psutil.Process(server.process.pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def _start(start_server, count: int = 3, **env: str):
    server = start_server(TEXEL_HTTP_PROCESSES=str(count), **env)
    # Ready means every HTTP process accepts connections: clients that connect at once
    # are spread over all of them.
    assert server.metric("texel_http_processes") == count
    return server


def _recognize_on_new_connections(server, count: int, concurrency: int = 6) -> list:
    image = formula_png()

    def post(_):  # a new connection each time, so the kernel hands them to any process
        return httpx.post(
            server.url + "/recognize", files={"image": ("f.png", image, "image/png")}, timeout=60
        )

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(post, range(count)))


def test_http_processes_share_the_port_batchers_and_metrics(start_server):
    server = _start(start_server, TEXEL_FORMULA__MAX_WAIT_MS="50")
    assert len(_http_children(server)) == 2
    responses = _recognize_on_new_connections(server, 30)
    assert [r.status_code for r in responses] == [200] * 30
    assert len({r.json()["latex"] for r in responses}) == 1  # same image, same answer
    forwarded = server.metric("texel_forwarded_requests_total")
    assert 0 < forwarded <= 30  # some came through the other two processes...
    # ...and /metrics, wherever it lands, adds up every process's request metrics.
    for _ in range(4):
        total = server.metric(
            "texel_request_duration_seconds_count", route="/recognize", status="200"
        )
        assert total == 30
    # Bad input is refused by whichever process took it, and changes nothing else.
    bad = [
        httpx.post(server.url + "/recognize", files={"image": ("f.png", b"not a png")})
        for _ in range(6)
    ]
    assert {r.status_code for r in bad} == {415} or {r.status_code for r in bad} == {400}
    assert server.metric("texel_requests_rejected_total", reason="invalid") == 6
    ready = [httpx.get(server.url + "/readyz") for _ in range(6)]
    assert all(r.status_code == 200 and r.json()["ready"] for r in ready)
    image = httpx.post(server.url + "/generate", json={"prompt": "x", "num_inference_steps": 2})
    assert image.status_code == 200


def test_a_batch_span_links_requests_traced_in_every_http_process(start_server):
    spans, lock = [], threading.Lock()

    def keep(request):
        with lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    spans.extend(scope.spans)

    server = _start(
        start_server,
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_sink(keep),
        OTEL_BSP_SCHEDULE_DELAY="100",
        TEXEL_FORMULA__MAX_WAIT_MS="300",
    )
    responses = _recognize_on_new_connections(server, 12)
    assert [r.status_code for r in responses] == [200] * 12
    assert server.metric("texel_forwarded_requests_total") > 0

    def generates():
        with lock:
            return [s for s in spans if s.name == "generate"]

    wait_for(lambda: len(generates()) == 12, timeout=30)
    with lock:
        batches = {s.span_id: s for s in spans if s.name == "batch"}
        traced = {s.trace_id for s in spans if s.name == "preprocess"}
    linked = set()
    for generate in generates():  # each request's generate span links its batch...
        (link,) = generate.links
        batch = batches[link.span_id]  # ...which the serving process exported
        members = {member.trace_id for member in batch.links}
        assert generate.trace_id in members
        linked |= members
    assert linked == traced and len(traced) == 12


def test_a_model_that_failed_to_load_fails_the_same_way_in_every_process(start_server, tmp_path):
    server = start_server(
        wait_ready=False, TEXEL_HTTP_PROCESSES="3", TEXEL_IMAGE__MODEL=str(tmp_path / "missing")
    )
    wait_for(lambda: server.metric("texel_http_processes") == 3, timeout=60)
    for _ in range(6):  # new connections: any process may answer
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["models"] == {"formula": "ready", "image": "failed"}
        image = httpx.post(server.url + "/generate", json={"prompt": "x"})
        assert image.status_code == 503 and image.json()["error"]["code"] == "model_failed"
    responses = _recognize_on_new_connections(server, 12)
    assert [r.status_code for r in responses] == [200] * 12


def test_a_killed_http_process_is_replaced_and_requests_keep_succeeding(start_server):
    server = _start(start_server, count=2)
    done = server.metric("texel_request_duration_seconds_count", route="/recognize")
    assert done == 0
    while not server.metric("texel_forwarded_requests_total"):  # until the child has some
        _recognize_on_new_connections(server, 4)
    done = server.metric("texel_request_duration_seconds_count", route="/recognize")
    (child,) = _http_children(server)
    child.kill()
    # A connection the kernel queued on the dead process's socket is reset (as are
    # those it held): wait_for polls with fresh ones until it is counted out.
    wait_for(lambda: server.metric("texel_http_processes") == 1, timeout=60)
    # The dead process's requests still count: summed counters never go down.
    assert server.metric("texel_request_duration_seconds_count", route="/recognize") == done
    responses = _recognize_on_new_connections(server, 8)
    assert [r.status_code for r in responses] == [200] * 8
    wait_for(lambda: server.metric("texel_http_processes") == 2, timeout=60)
    total = server.metric("texel_request_duration_seconds_count", route="/recognize")
    assert total == done + 8
    (replacement,) = _http_children(server)
    assert replacement.pid != child.pid
    assert "exited with code -9" in server.log_path.read_text()


def test_sigterm_lets_every_process_finish_its_requests_then_stops_them_all(start_server):
    server = _start(start_server, TEXEL_SHUTDOWN_GRACE_S="1", TEXEL_IMAGE__MAX_BATCH_SIZE="1")
    children = _http_children(server)

    def post(i):
        return httpx.post(server.url + "/generate", json={**SLOW, "seed": i}, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, i) for i in range(4)]
        # The in-flight gauge is summed over the processes that hold the requests.
        wait_for(lambda: server.metric("texel_inflight_requests", route="/generate") >= 4)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(server.url + "/readyz")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        assert [f.result().status_code for f in futures] == [200] * 4
    assert server.process.wait(60) in (0, -signal.SIGTERM)
    wait_for(lambda: not any(c.is_running() and c.status() != "zombie" for c in children), 10)


# -- the channel itself ---------------------------------------------------------------


class _Far:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def rpc_echo(self, value):
        return value

    def rpc_full(self):
        raise QueueFull(7, 2.5)

    def rpc_missing(self):
        raise ApiError(404, "model_disabled", "not here", {"X-Why": "test"})

    async def rpc_forever(self):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _pair(far_handler):
    left, right = socket.socketpair(socket.AF_UNIX)
    near = Channel(*await asyncio.open_unix_connection(sock=left), object(), "near")
    far = Channel(*await asyncio.open_unix_connection(sock=right), far_handler, "far")
    return near, far


def test_the_channel_carries_results_errors_and_cancellation():
    async def scenario():
        handler = _Far()
        near, far = await _pair(handler)
        big = bytes(range(256)) * 20_000  # 5 MB: more than the socket buffers at once
        assert await near.call("echo", big) == big
        with pytest.raises(QueueFull) as raised:
            await near.call("full")
        assert raised.value.retry_after_s == 2.5 and raised.value.waiting == 7
        with pytest.raises(ApiError) as refused:
            await near.call("missing")
        assert (refused.value.status, refused.value.headers) == (404, {"X-Why": "test"})
        waiting = asyncio.create_task(near.call("forever"))
        await asyncio.sleep(0.1)
        waiting.cancel()
        await asyncio.wait_for(handler.cancelled.wait(), 5)  # the far task was cancelled
        # A cancel that arrives with its call, before the far task starts, leaves nothing.
        early = asyncio.create_task(near.call("forever"))
        await asyncio.sleep(0)
        early.cancel()
        await asyncio.sleep(0.1)
        assert far._serving == {}
        pending = asyncio.create_task(near.call("forever"))
        await asyncio.sleep(0.1)
        far.close()
        with pytest.raises(ChannelClosed):
            await pending
        with pytest.raises(ChannelClosed):
            await near.call("echo", 1)

    asyncio.run(scenario())


def _idle_connection_closed(url: str, idle_s: float) -> bool:
    """Whether the server closes a kept-alive connection left idle for `idle_s`."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", "/livez")
        first = connection.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        time.sleep(idle_s)
        try:
            connection.request("GET", "/livez")
            return connection.getresponse().status != 200
        except (http.client.RemoteDisconnected, ConnectionError):
            return True
    finally:
        connection.close()


@pytest.mark.parametrize("processes", [1, 2])
def test_idle_connections_stay_open_for_the_keep_alive_setting(start_server, processes):
    """uvicorn's own 5 s keep-alive closes connections that clients and proxies still
    count as open; Texel keeps them TEXEL_KEEP_ALIVE_S (75 s by default)."""
    bare = {"TEXEL_FORMULA__ENABLED": "false", "TEXEL_IMAGE__ENABLED": "false"}
    short = start_server(wait_ready=False, TEXEL_HTTP_PROCESSES=str(processes),
                         TEXEL_KEEP_ALIVE_S="1", **bare)  # fmt: skip
    default = start_server(wait_ready=False, TEXEL_HTTP_PROCESSES=str(processes), **bare)
    assert _idle_connection_closed(short.url, 2.5)
    assert not _idle_connection_closed(default.url, 6.0)  # past uvicorn's 5 s
