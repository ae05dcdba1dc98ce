"""The benchmark client: closed- and open-loop load split over processes pools every answer."""

from __future__ import annotations

import httpx

from bench.load import Workload, closed_loop_processes, open_loop_processes
from tests.conftest import formula_png


def recognize_requests_served(url: str) -> float:
    """Requests /recognize has answered, from the server's own metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("texel_request_duration_seconds_count{") and "/recognize" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def two_formulas() -> Workload:
    """Uploads of two formula pictures in turn to /recognize."""
    images = [formula_png("x+1"), formula_png("a^2")]
    return Workload(
        "POST",
        "/recognize",
        lambda i: {"files": {"image": ("f.png", images[i % 2], "image/png")}},
    )


def test_closed_loop_over_two_processes_pools_every_request(server):
    workload = two_formulas()
    before = recognize_requests_served(server.url)
    result = closed_loop_processes(
        server.url, workload, concurrency=4, duration_s=1.5, warmup_s=0, processes=2
    )
    served = recognize_requests_served(server.url) - before
    assert result.mode == "closed" and result.level == 4
    assert result.ok > 0 and result.errors == {}
    assert sum(result.statuses.values()) == served  # both processes' requests, each once
    assert len(result.latencies_s) == result.ok


def test_open_loop_over_two_processes_pools_every_request_after_its_warmup(server):
    """Poisson arrivals from two processes at half the rate each: every recorded request
    once, each with its lateness; the warm-up's requests served but not recorded."""
    workload = two_formulas()
    before = recognize_requests_served(server.url)
    result = open_loop_processes(
        server.url, workload, rate_rps=30, duration_s=1.0, warmup_s=0.5, processes=2
    )
    served = recognize_requests_served(server.url) - before
    recorded = sum(result.statuses.values())
    assert result.mode == "open" and result.level == 30
    assert result.ok > 0 and result.errors == {}
    assert len(result.latencies_s) == result.ok and len(result.late_s) == recorded
    assert served > recorded  # the warm-up's arrivals were answered too
    assert "client_late_p99_ms" in result.summary()


def test_each_closed_loop_client_keeps_one_connection_of_its_own(tmp_path):
    """Like browsers: every client keeps one connection, and none reconnects, so the
    server sees exactly one connection per client; the open loop works the same way.
    (Why no shared pool: its CPU cost per request grows with its size, a measurement in
    `closed_loop`'s docstring, not something a test can time.)"""
    import asyncio

    from bench.load import closed_loop, open_loop

    connections: set = set()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        connections.add(tuple(scope["client"]))
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def run() -> tuple:
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        workload = Workload("POST", "/", lambda i: {"json": {"i": i}})
        closed = await closed_loop(url, workload, 24, duration_s=1.0, warmup_s=0.2)
        closed_connections = len(connections)
        opened = await open_loop(url, workload, rate_rps=50, duration_s=0.5)
        server.should_exit = True
        await task
        return closed, closed_connections, opened

    closed, closed_connections, opened = asyncio.run(run())
    assert closed.errors == {} and closed.ok > 24 * 3
    assert closed_connections == 24
    assert opened.errors == {} and opened.ok > 0
