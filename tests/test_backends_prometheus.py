"""Texel's metrics in a real Prometheus: series, per-stage quantiles and trace exemplars.

Debian's prometheus package (fetched by tests/backends/prometheus.sh) runs with
exemplar storage on a free port, scraping a real Texel with tiny models every
second with the compose stack's scrape job. The test makes requests under its
own trace ids and reads everything back through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import math
import secrets
import time

import httpx
import pytest
import yaml

from tests.backends import BackgroundProcess, ensure_backend
from tests.conftest import ROOT, formula_png, free_port
from tests.server import ServerProcess

COMPOSE = ROOT / "deploy" / "compose"
STAGES = {"http.parse", "preprocess", "tokenize", "queue.wait", "generate", "postprocess"}
GPU_ONLY = ("texel_gpu_", "texel_torch_")
# Requests per phase; each phase sends one of each of these.
ROUTES = ("recognize", "generate", "invalid")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def texel(tiny_env):
    proc = ServerProcess({**tiny_env, "TEXEL_FORMULA__MAX_WAIT_MS": "20"})
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def prometheus(texel, tmp_path_factory):
    """A real Prometheus with exemplar storage, scraping `texel` every second."""
    binaries = ensure_backend("prometheus.sh")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "texel")
    job["static_configs"] = [{"targets": [f"127.0.0.1:{texel.port}"]}]
    job["scrape_interval"] = "1s"
    config["scrape_configs"] = [job]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = BackgroundProcess(
        [
            str(binaries / "prometheus"),
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ],
        workdir / "prometheus.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/-/ready", timeout=60)
        yield PrometheusApi(url, proc)
    finally:
        proc.stop()


class PrometheusApi:
    def __init__(self, url: str, process: BackgroundProcess) -> None:
        self.url = url
        self.process = process

    def get(self, path: str, **params) -> list | dict:
        response = httpx.get(self.url + path, params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", (path, params, body, self.process.log())
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else 0.0

    def wait_for(self, expr: str, at_least: float, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (value := self.scalar(expr)) < at_least:
            assert time.monotonic() < deadline, (
                f"{expr} = {value} < {at_least}\n{self.process.log()}"
            )
            time.sleep(0.5)


def send(texel: ServerProcess, route: str, trace_id: str | None = None) -> httpx.Response:
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"} if trace_id else {}
    with texel.client(headers=headers) as client:
        if route == "recognize":
            files = {"image": ("f.png", formula_png(), "image/png")}
            response = client.post("/recognize", files=files)
        elif route == "generate":
            response = client.post("/generate", json={"prompt": "a red square", "seed": 1})
        else:
            files = {"image": ("f.png", b"not an image", "image/png")}
            response = client.post("/recognize", files=files)
    assert (response.status_code == 200) == (route != "invalid"), response.text
    return response


@pytest.fixture(scope="module")
def traced(texel, prometheus) -> set[str]:
    """Trace ids of the test's own requests, sent once Prometheus already had Texel's series.

    Two phases, so a `rate()` over the last minute sees the counters move.
    """
    requests = "sum(texel_request_duration_seconds_count)"
    for route in ROUTES:
        send(texel, route)
    prometheus.wait_for(requests, len(ROUTES))
    trace_ids = set()
    for route in ROUTES:
        trace_id = secrets.token_hex(16)
        send(texel, route, trace_id)
        trace_ids.add(trace_id)
    prometheus.wait_for(requests, 2 * len(ROUTES))
    return trace_ids


def test_prometheus_scrapes_texel(prometheus, traced):
    (target,) = prometheus.get("/api/v1/targets")["activeTargets"]
    assert target["health"] == "up", target
    assert prometheus.scalar('up{job="texel"}') == 1


def test_texels_series_are_in_prometheus(prometheus, traced):
    names = set(prometheus.get("/api/v1/label/__name__/values"))
    for name in (
        "texel_stage_duration_seconds_bucket",
        "texel_request_duration_seconds_count",
        "texel_queue_wait_seconds_bucket",
        "texel_batch_size_bucket",
        "texel_queue_depth",
        "texel_requests_rejected_total",
        "texel_model_ready",
        "texel_process_cpu_utilization_ratio",
    ):
        assert name in names, name


def test_histogram_quantile_gives_a_latency_for_every_stage(prometheus, traced):
    expr = (
        "histogram_quantile(0.95, sum by (le, stage) "
        "(rate(texel_stage_duration_seconds_bucket[1m])))"
    )
    quantiles = {r["metric"]["stage"]: float(r["value"][1]) for r in prometheus.query(expr)}
    assert set(quantiles) >= STAGES, quantiles
    for stage in STAGES:
        assert math.isfinite(quantiles[stage]) and quantiles[stage] >= 0, (stage, quantiles)


def test_a_stage_exemplar_carries_the_trace_id_of_one_of_the_tests_requests(prometheus, traced):
    now = time.time()
    series = prometheus.get(
        "/api/v1/query_exemplars",
        query="texel_stage_duration_seconds_bucket",
        start=now - 300,
        end=now + 10,
    )
    seen = {
        (s["seriesLabels"].get("stage"), e["labels"].get("trace_id"))
        for s in series
        for e in s["exemplars"]
    }
    ours = {(stage, trace_id) for stage, trace_id in seen if trace_id in traced}
    assert ours, f"no exemplar with the test's trace ids {traced}; exemplars seen: {seen}"


def test_a_request_exemplar_carries_the_trace_id_of_one_of_the_tests_requests(prometheus, traced):
    now = time.time()
    series = prometheus.get(
        "/api/v1/query_exemplars",
        query="texel_request_duration_seconds_bucket",
        start=now - 300,
        end=now + 10,
    )
    trace_ids = {e["labels"].get("trace_id") for s in series for e in s["exemplars"]}
    assert trace_ids & traced, f"exemplars seen: {trace_ids}, the test's: {traced}"


def test_every_dashboard_query_returns_data_from_a_cpu_texel(prometheus, traced):
    dashboard = json.loads((COMPOSE / "grafana" / "dashboards" / "texel.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$__rate_interval", "1m")
                .replace("$__interval", "15s")
                .replace("$model", ".*")
            )
            result = prometheus.query(expr)  # fails on a PromQL error
            if any(name in expr for name in GPU_ONLY):
                continue  # no GPU series on this machine
            assert result, f"'{panel['title']}' shows nothing: {expr}"
