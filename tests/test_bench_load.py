"""The benchmark client: closed-loop load split over processes pools every answer."""

from __future__ import annotations

import httpx

from bench.load import Workload, closed_loop_processes
from tests.conftest import formula_png


def recognize_requests_served(url: str) -> float:
    """Requests /recognize has answered, from the server's own metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("texel_request_duration_seconds_count{") and "/recognize" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_closed_loop_over_two_processes_pools_every_request(server):
    images = [formula_png("x+1"), formula_png("a^2")]
    workload = Workload(
        "POST",
        "/recognize",
        lambda i: {"files": {"image": ("f.png", images[i % 2], "image/png")}},
    )
    before = recognize_requests_served(server.url)
    result = closed_loop_processes(
        server.url, workload, concurrency=4, duration_s=1.5, warmup_s=0, processes=2
    )
    served = recognize_requests_served(server.url) - before
    assert result.mode == "closed" and result.level == 4
    assert result.ok > 0 and result.errors == {}
    assert sum(result.statuses.values()) == served  # both processes' requests, each once
    assert len(result.latencies_s) == result.ok
