"""Batches run in a worker process of their own (`TEXEL_WORKER_PROCESSES`)."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import psutil
import pytest

from batching import BatchFailed, OutOfMemory, ProcessRunner
from tests.test_preprocess_processes import (
    formulas_and_threaded_answers,
    recognize_all,
    spawned_workers,
)

# -- the runner, with a plain function in the child ---------------------------


def _doubler(payloads, should_stop):
    if "boom" in payloads:
        raise ValueError("boom in the child")
    if "oom" in payloads:
        raise OutOfMemory("does not fit")
    if "die" in payloads:
        os._exit(3)
    if "wait" in payloads:  # until the parent says stop
        deadline = time.monotonic() + 30
        while not should_stop() and time.monotonic() < deadline:
            time.sleep(0.01)
        return ["stopped" if should_stop() else "timed out"]
    return [p * 2 for p in payloads]


_ran = 0


def _counting_doubler(payloads, should_stop):
    global _ran
    _ran += 1
    return _doubler(payloads, should_stop)


def build_counting_doubler():
    return _counting_doubler, {}


def report_batches_run():
    return {"pid": os.getpid(), "batches": _ran}


def build_doubler(fail: bool = False):
    if fail:
        raise RuntimeError("could not load the model")
    return _doubler, {"ready_at": time.time()}


@pytest.fixture
def runner():
    runner = ProcessRunner(build_doubler, name="texel-test-worker")
    yield runner
    runner.close()


def test_a_worker_process_runs_batches_and_reports_its_errors(runner):
    info = runner.start()
    assert "ready_at" in info and runner.pid is not None
    assert psutil.Process(runner.pid).ppid() == psutil.Process().pid
    assert runner([1, 2, 3], lambda: False) == [2, 4, 6]
    with pytest.raises(ValueError, match="boom in the child"):
        runner(["boom"], lambda: False)
    with pytest.raises(OutOfMemory):  # the batcher splits a batch on this one
        runner(["oom"], lambda: False)
    assert runner(["a"], lambda: False) == ["aa"]  # still serving after errors


def test_a_worker_process_reports_after_start_and_every_batch():
    runner = ProcessRunner(
        build_counting_doubler, name="texel-test-report", report=report_batches_run
    )
    try:
        runner.start()
        assert runner.reported == {"pid": runner.pid, "batches": 0}
        runner([1], lambda: False)
        assert runner.reported == {"pid": runner.pid, "batches": 1}
        with pytest.raises(ValueError):
            runner(["boom"], lambda: False)
        assert runner.reported["batches"] == 2  # failed batches report too
    finally:
        runner.close()


def test_worker_memory_reaches_the_torch_allocator_gauges():
    """With worker processes the model's GPU memory is theirs; what they report is
    published as texel_torch_*_bytes by the serving process (no GPU here: a stand-in
    source, which is what ServedModel registers for its runners)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from telemetry.resources import (
        ResourceCollector,
        add_allocator_source,
        remove_allocator_source,
    )

    registry = CollectorRegistry()
    registry.register(ResourceCollector())

    def source():
        return {"cuda:1": (1000, 4096)}

    add_allocator_source(source)
    try:
        text = generate_latest(registry).decode()
    finally:
        remove_allocator_source(source)
    assert 'texel_torch_allocated_bytes{device="cuda:1"} 1000.0' in text
    assert 'texel_torch_reserved_bytes{device="cuda:1"} 4096.0' in text
    assert "texel_torch_allocated_bytes{" not in generate_latest(registry).decode()


def test_should_stop_reaches_the_worker_process(runner):
    runner.start()
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert runner(["wait"], stop.is_set) == ["stopped"]
    assert time.monotonic() - started < 10


def test_a_worker_that_cannot_load_fails_start_and_exits():
    runner = ProcessRunner(functools.partial(build_doubler, fail=True), name="texel-test-fail")
    with pytest.raises(RuntimeError, match="could not load the model"):
        runner.start()
    assert not psutil.pid_exists(runner.pid) or psutil.Process(runner.pid).status() == "zombie"


def test_a_worker_that_dies_fails_its_batch_and_is_started_again(runner):
    runner.start()
    first = runner.pid
    with pytest.raises(BatchFailed, match="died .exit code 3"):
        runner(["die"], lambda: False)
    assert runner([1], lambda: False) == [2]  # a new worker, loaded anew
    assert runner.restarts == 1 and runner.pid != first

    # Killed while idle, the next batch sent at once (the pipe may still take it): the
    # worker never took it, so it runs on a new worker instead of failing.
    psutil.Process(runner.pid).kill()
    assert runner([2], lambda: False) == [4]
    assert runner.restarts == 2


# -- a real server --------------------------------------------------------------


def generated_png(proc, seed: int) -> str:
    with proc.client() as client:
        response = client.post("/generate", json={"prompt": "a red circle", "seed": seed})
    assert response.status_code == 200, response.text
    return response.json()["images"][0]["png_base64"]


def test_a_server_with_worker_processes_gives_the_same_answers(start_server):
    images, expected = formulas_and_threaded_answers(start_server)
    threads = start_server()
    expected_image = generated_png(threads, seed=5)
    threads.stop()

    server = start_server(TEXEL_WORKER_PROCESSES="true", TEXEL_FORMULA__MAX_WAIT_MS="50")
    workers = spawned_workers(server)
    assert len(workers) == 2, [c.cmdline() for c in workers]  # formulas and images, on the CPU
    assert recognize_all(server, images) == expected
    assert generated_png(server, seed=5) == expected_image
    with server.client() as client:
        # The serving process still sees every batch and every stage.
        metrics = client.get("/metrics").text
        batches = [
            line for line in metrics.splitlines() if line.startswith("texel_batch_size_count")
        ]
        assert len(batches) == 2 and all(float(b.split()[-1]) >= 1 for b in batches), batches
        assert 'stage="generate"' in metrics and "texel_output_tokens" in metrics
        truncated = client.post("/recognize", files={"image": ("f.png", images[0][:200])})
        assert truncated.status_code == 400, truncated.text
        too_many_steps = client.post(
            "/generate", json={"prompt": "x", "num_inference_steps": 10**4}
        )
        assert too_many_steps.status_code == 422, too_many_steps.text

    server.stop(signal.SIGKILL)  # killed outright, the workers still go
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.pid for p in alive]
