"""Four-quadrant bottleneck diagnosis."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import httpx
import psutil
import pytest

from telemetry.bottleneck import BottleneckSampler, Sample, classify
from telemetry.resources import usable_cores
from tests.server import ROOT


def sample(cpu=0.1, thread=0.1, gpu=0.1, stages=None) -> Sample:
    return Sample(cpu, thread, gpu, stages or {"generate": 1.0, "preprocess": 0.2}, 10.0)


def test_the_four_quadrants():
    assert classify(sample(cpu=0.9, gpu=0.1)).quadrant == "cpu_bound"
    assert classify(sample(cpu=0.1, gpu=0.9)).quadrant == "gpu_bound"
    assert classify(sample(cpu=0.1, gpu=0.1)).quadrant == "starved"
    assert classify(sample(cpu=0.9, gpu=0.9)).quadrant == "saturated"


def test_one_saturated_thread_counts_as_cpu_bound_on_a_many_core_machine():
    verdict = classify(sample(cpu=0.07, thread=0.98, gpu=0.2))
    assert verdict.quadrant == "cpu_bound"


def test_without_a_gpu_the_verdict_says_so():
    verdict = classify(sample(cpu=0.9, gpu=None))
    assert verdict.quadrant == "cpu_bound" and "no GPU" in verdict.explanation
    assert verdict.gpu_utilization is None


def test_the_dominant_stage_and_shares_are_reported():
    verdict = classify(sample(stages={"preprocess": 3.0, "generate": 1.0}))
    assert verdict.dominant_stage == "preprocess"
    assert verdict.stage_shares == {"preprocess": 0.75, "generate": 0.25}


class FakeStages:
    """Stage totals that grow while a fake model works, like the real histograms."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + seconds

    def __call__(self) -> dict[str, float]:
        with self.lock:
            return dict(self.totals)


def run_while_sampling(work, gpu_probe, stages: FakeStages):
    stop = threading.Event()
    worker = threading.Thread(target=work, args=(stop, stages))
    worker.start()
    try:
        return asyncio.run(BottleneckSampler(gpu_probe, stages).diagnose(window_s=1.5))
    finally:
        stop.set()
        worker.join()


def cpu_heavy_model(stop: threading.Event, stages: FakeStages) -> None:
    """Decoding images on every core (zlib releases the GIL), leaving the GPU idle."""
    data = os.urandom(1 << 20)

    def burn() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            zlib.compress(data, 6)
            stages.add("preprocess", time.perf_counter() - started)

    threads = [threading.Thread(target=burn) for _ in range(os.cpu_count() or 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def compute_heavy_model(stop: threading.Event, stages: FakeStages) -> None:
    """Waiting on GPU kernels: the CPU sleeps in `generate` while the GPU is busy."""
    while not stop.is_set():
        time.sleep(0.05)
        stages.add("generate", 0.05)


def test_a_cpu_heavy_model_is_diagnosed_cpu_bound_in_preprocess():
    verdict = run_while_sampling(cpu_heavy_model, lambda: 0.05, FakeStages())
    assert verdict.quadrant == "cpu_bound", verdict
    assert verdict.dominant_stage == "preprocess"
    # What it got of the cores, and what it waited for while other programs had them.
    assert verdict.cpu_utilization + (verdict.cpu_wait or 0.0) > 0.6


def test_threads_kept_off_the_cores_count_as_cpu_the_server_wanted():
    """Twice as many busy threads as cores: each waits for a core about half the time,
    which Linux's run-queue wait shows, whoever else shares the machine."""
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel keeps no run-queue wait")

    def oversubscribed(stop: threading.Event, stages: FakeStages) -> None:
        data = os.urandom(1 << 20)

        def burn() -> None:
            while not stop.is_set():
                zlib.compress(data, 6)

        threads = [threading.Thread(target=burn) for _ in range(2 * usable_cores())]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    stop = threading.Event()
    worker = threading.Thread(target=oversubscribed, args=(stop, FakeStages()))
    worker.start()
    try:
        sampler = BottleneckSampler(lambda: None, FakeStages(), loop_lag=lambda: (0, 0))
        sample = asyncio.run(sampler.sample(window_s=1.0, interval_s=0.2))
    finally:
        stop.set()
        worker.join()
    assert sample.cpu_wait is not None and sample.cpu_wait >= 0.2, sample


def test_a_server_a_neighbour_keeps_off_the_cores_is_cpu_bound_and_told_so():
    # Its threads ran on 30% of the cores and waited for them another 40%.
    held_back = Sample(0.3, 0.3, None, {"preprocess": 1.0}, 10.0, cpu_wait=0.4)
    verdict = classify(held_back)
    assert verdict.quadrant == "cpu_bound" and verdict.cpu_wait == 0.4
    assert "waited for a core 40%" in verdict.explanation
    # The same CPU without the wait is a server with too little to do.
    assert classify(Sample(0.3, 0.3, None, {"preprocess": 1.0}, 10.0)).quadrant == "starved"


def test_a_compute_heavy_model_is_diagnosed_gpu_bound_in_generate():
    verdict = run_while_sampling(compute_heavy_model, lambda: 0.97, FakeStages())
    assert verdict.quadrant == "gpu_bound", verdict
    assert verdict.dominant_stage == "generate"


def test_the_server_answers_a_diagnosis(server):
    response = httpx.get(server.url + "/debug/bottleneck", params={"window_s": 1}, timeout=30)
    assert response.status_code == 200
    verdict = response.json()
    assert verdict["quadrant"] in {"cpu_bound", "gpu_bound", "starved", "saturated"}
    assert verdict["gpu_utilization"] is None  # no GPU here: absent, not zero
    bad = httpx.get(server.url + "/debug/bottleneck", params={"window_s": 0}, timeout=30)
    assert bad.status_code == 422


def test_a_late_event_loop_counts_as_cpu_bound_and_says_why():
    late = Sample(0.1, 0.2, 0.1, {"generate": 1.0}, 10.0, event_loop_lag_s=0.08)
    verdict = classify(late)
    assert verdict.quadrant == "cpu_bound"
    assert "80 ms late" in verdict.explanation and verdict.event_loop_lag_s == 0.08
    on_time = Sample(0.1, 0.2, 0.1, {"generate": 1.0}, 10.0, event_loop_lag_s=0.001)
    assert classify(on_time).quadrant == "starved"


def test_the_advice_names_only_settings_texel_reads():
    from app import config_doc

    late = Sample(0.1, 0.2, 0.1, {"generate": 1.0}, 10.0, event_loop_lag_s=0.08)
    named = re.findall(r"TEXEL_\w+", classify(late).explanation)
    assert named, "the advice names the settings to change"
    reference = config_doc.render()
    assert [name for name in named if f"`{name}`" not in reference] == []


async def test_the_event_loop_watch_sees_a_blocked_loop():

    from telemetry.bottleneck import loop_lag_totals, watch_event_loop

    watch = asyncio.ensure_future(watch_event_loop(interval_s=0.02))
    await asyncio.sleep(0.1)  # a few on-time samples first
    before_sum, before_count = loop_lag_totals()
    time.sleep(0.3)  # blocks the loop, as a busy loop or a held GIL would
    await asyncio.sleep(0.1)
    watch.cancel()
    after_sum, after_count = loop_lag_totals()
    assert after_count > before_count
    assert after_sum - before_sum >= 0.25  # the timer due during the block fired ~0.3 s late


def test_the_server_reports_event_loop_lag(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        time.sleep(0.5)  # the watch samples every 100 ms from start-up
        text = client.get("/metrics").text
    assert "texel_event_loop_lag_seconds_count" in text
    count = [ln for ln in text.splitlines() if ln.startswith("texel_event_loop_lag_seconds_count")]
    assert float(count[0].rsplit(" ", 1)[1]) > 0


def test_each_garbage_collection_is_timed_by_generation_and_recorded_by_the_event_loop():
    """The collector's callback only notes the pause: a collection can start inside a
    metric's update, so the event loop's watch puts the pauses into the histogram."""
    from telemetry import metrics
    from telemetry.bottleneck import record_collections, watch_garbage_collector

    def sample(suffix: str) -> float:
        value = metrics.REGISTRY.get_sample_value(
            f"texel_gc_pause_seconds_{suffix}", {"generation": "2"}
        )
        return value or 0.0

    watch_garbage_collector()
    watch_garbage_collector()  # installs one callback, however often it is called
    record_collections()
    before = sample("count")
    gc.collect()
    assert sample("count") == before, "not from inside the collector's callback"
    record_collections()
    assert sample("count") == before + 1
    assert sample("sum") > 0


def test_the_server_reports_its_garbage_collections(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        text = client.get("/metrics").text
    lines = text.splitlines()
    counts = [ln for ln in lines if ln.startswith("texel_gc_pause_seconds_count")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in counts) >= 1  # start-up runs many
    frozen = [ln for ln in lines if ln.startswith("texel_gc_frozen_objects ")]
    assert float(frozen[0].rsplit(" ", 1)[1]) > 10_000, "the start-up heap is frozen once ready"


# A stand-in launcher, started by a process that exits at once (so it is no descendant
# of the sampling process), whose child spins as a busy engine process would.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys
    spinner = "import time\\nend = time.time() + 60\\nwhile time.time() < end:\\n    pass"
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {spinner!r}])"
    code += "; time.sleep(60)"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    launcher = subprocess.Popen([sys.executable, "-c", code], **quiet)
    print(launcher.pid)
    """
)


async def test_the_cpu_of_every_process_under_the_launcher_counts(monkeypatch):
    """Engine and HTTP processes are the launcher's children: a busy one is busy CPU of
    this server, whichever process samples (a sampler blind to it would say 'starved')."""
    started = subprocess.run(
        [sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=30
    )
    launcher = psutil.Process(int(started.stdout))
    try:
        deadline = time.monotonic() + 10
        while not launcher.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launcher.children() and launcher not in psutil.Process().children(recursive=True)
        monkeypatch.setenv("TEXEL_LAUNCHER_PID", str(launcher.pid))
        sampler = BottleneckSampler(gpu_probe=lambda: None, stages=dict, loop_lag=lambda: (0, 0))
        sample = await sampler.sample(window_s=1.0, interval_s=0.2)
    finally:
        for process in [*launcher.children(), launcher]:
            process.kill()
    # A spinning process wants a whole core: it runs on one, or waits for its turn on a
    # machine busy with others.
    assert sample.busiest_thread_utilization > 0.0, sample
    wanted = sample.cpu_utilization + (sample.cpu_wait or 0.0)
    assert wanted >= 0.6 / usable_cores(), sample


# In multiprocess mode (as the launcher runs Texel) one process observes a stage and
# the event loop's lag, another reads the totals the sampler starts from.
TOTALS_OVER_PROCESSES = textwrap.dedent(
    """
    import json, os, subprocess, sys, tempfile
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp()
    from telemetry import metrics
    from telemetry.bottleneck import loop_lag_totals, stage_totals
    metrics.STAGE_DURATION.labels("formula", "preprocess").observe(0.5)
    other = (
        "from telemetry import metrics; "
        "metrics.STAGE_DURATION.labels('image', 'preprocess').observe(0.25); "
        "metrics.STAGE_DURATION.labels('image', 'generate').observe(2.0); "
        "metrics.EVENT_LOOP_LAG.observe(0.04)"
    )
    subprocess.run([sys.executable, "-c", other], check=True)
    print(json.dumps({"stages": stage_totals(), "lag": loop_lag_totals()}))
    """
)


def test_every_processs_stage_times_and_loop_lag_count():
    done = subprocess.run(
        [sys.executable, "-c", TOTALS_OVER_PROCESSES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    totals = json.loads(done.stdout.splitlines()[-1])
    assert totals["stages"] == {"preprocess": pytest.approx(0.75), "generate": pytest.approx(2.0)}
    assert totals["lag"] == [pytest.approx(0.04), 1.0]


def test_a_diagnosis_leaves_the_cpu_gauges_window_to_the_scrapes():
    """The CPU gauge covers the time since the previous scrape; a diagnosis reading the
    metrics in between made the next scrape's window start where the diagnosis ended."""
    from telemetry import metrics

    meter = metrics._RESOURCES.cpu
    metrics.exposition(None)
    window = meter._last
    asyncio.run(BottleneckSampler(gpu_probe=lambda: None).diagnose(0.05))
    assert meter._last == window
    text, _ = metrics.exposition(None)
    assert meter._last != window
    assert b"texel_process_cpu_utilization_ratio " in text
