"""What `/metrics` tells an operator of a server of several processes (a launcher, an
engine and two HTTP processes), read from a real one with tiny models."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.settings import Settings
from telemetry.resources import usable_cores
from tests.conftest import ServerProcess, formula_png

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tiny_env):
    proc = ServerProcess({**tiny_env, "TEXEL_HTTP_PROCESSES": "2"})
    yield proc
    proc.stop()


def families(server: ServerProcess) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def server_cpu_seconds(launcher: psutil.Process) -> float:
    """CPU seconds so far of the launcher and every live process under it."""
    total = 0.0
    for process in [launcher, *launcher.children(recursive=True)]:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def test_process_cpu_counts_the_engines_work_not_only_the_scraped_http_process(server):
    """Denoising runs in the engine process; whichever HTTP process answers the scrape,
    the CPU it reports is the server's, as `ps` would add it up."""
    stop = threading.Event()

    def generate() -> None:  # long denoising loops: the engine is busy, HTTP idle
        with server.client() as client:
            while not stop.is_set():
                client.post(
                    "/generate", json={"prompt": "a red square", "num_inference_steps": 100}
                )

    launcher = psutil.Process(server.process.pid)
    loaders = [threading.Thread(target=generate) for _ in range(2)]
    for thread in loaders:
        thread.start()
    try:
        time.sleep(1)
        families(server)  # each HTTP process's window starts at its previous scrape
        families(server)
        readings, started = [], (time.monotonic(), server_cpu_seconds(launcher))
        for _ in range(6):
            time.sleep(1)
            sample = families(server)["texel_process_cpu_utilization_ratio"].samples[0]
            readings.append(sample.value)
        elapsed = time.monotonic() - started[0]
        used = (server_cpu_seconds(launcher) - started[1]) / (elapsed * usable_cores())
    finally:
        stop.set()
        for thread in loaders:
            thread.join(60)
    assert used > 0.05, f"the load kept the server too idle to tell: {used:.3f}"
    reported = statistics.median(readings)
    assert reported >= 0.5 * used, (reported, used, readings)


def test_request_latency_buckets_reach_past_the_default_request_deadline(server):
    """A request answered 504 at `TEXEL_REQUEST_TIMEOUT_S` (or just before it) lands in a
    finite bucket, so `histogram_quantile` does not stop at the largest bound below it."""
    deadline = Settings.model_fields["request_timeout_s"].default
    with server.client() as client:
        client.post("/generate", json={"prompt": "a red square"})
    bounds = {
        float(s.labels["le"])
        for name in ("texel_request_duration_seconds", "texel_stage_duration_seconds")
        for s in families(server)[name].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    }
    assert max(bounds) > deadline, (sorted(bounds), deadline)


def test_latency_buckets_resolve_the_sub_millisecond_response_stages(server):
    """A formula's response stages take tens of microseconds on a GPU box (on the event
    loop): the lowest bucket is below them, not a half-millisecond catch-all."""
    with server.client() as client:
        files = {"image": ("f.png", formula_png(), "image/png")}
        assert client.post("/recognize", files=files).status_code == 200
    bounds = sorted(
        float(s.labels["le"])
        for s in families(server)["texel_stage_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        and s.labels["stage"] == "postprocess" and s.labels["model"] == "formula"
    )  # fmt: skip
    assert bounds and bounds[0] <= 0.0001, bounds
