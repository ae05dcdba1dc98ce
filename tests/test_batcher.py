"""The asyncio batcher with fake models: batching, deadlines, cancellation, failures, draining."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from batching import (
    Batcher,
    BatchFailed,
    BatchPolicy,
    DeadlineExceeded,
    Draining,
    OutOfMemory,
    QueueFull,
    Worker,
)


class FakeModel:
    """Doubles its inputs; records every batch it ran. Optional delay, failures and OOM limit."""

    def __init__(self, delay_s: float = 0.0, fail_on=None, max_fit: int | None = None):
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.max_fit = max_fit
        self.batches: list[list] = []
        self.started = threading.Event()
        self.stopped_early = False

    def __call__(self, payloads, should_stop):
        if self.max_fit is not None and len(payloads) > self.max_fit:
            raise OutOfMemory(f"{len(payloads)} > {self.max_fit}")
        self.started.set()
        if self.fail_on is not None and self.fail_on in payloads:
            raise RuntimeError("boom")
        self.batches.append(list(payloads))
        deadline = time.monotonic() + self.delay_s
        while time.monotonic() < deadline:
            if should_stop():
                self.stopped_early = True
                return [ValueError("stopped")] * len(payloads)
            time.sleep(0.005)
        return [p * 2 for p in payloads]


def make_batcher(model, **policy) -> Batcher:
    defaults = dict(max_batch_size=4, max_wait_s=0.05, max_queue=64)
    batcher = Batcher("fake", [Worker("cpu", model)], BatchPolicy(**{**defaults, **policy}))
    batcher.start()
    return batcher


async def test_concurrent_requests_of_one_bucket_share_a_batch():
    model = FakeModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_s=0.2)
    results = await asyncio.gather(*(batcher.submit(i, bucket="a", timeout_s=5) for i in range(4)))
    assert [r.value for r in results] == [0, 2, 4, 6]
    assert [r.batch_size for r in results] == [4, 4, 4, 4]
    assert model.batches == [[0, 1, 2, 3]]
    await batcher.close()


async def test_a_lone_request_runs_after_max_wait():
    model = FakeModel()
    batcher = make_batcher(model, max_batch_size=8, max_wait_s=0.05)
    started = time.monotonic()
    result = await batcher.submit(21, bucket="a", timeout_s=5)
    elapsed = time.monotonic() - started
    assert result.value == 42 and result.batch_size == 1
    assert 0.04 <= elapsed < 1.0
    assert result.queue_wait_s >= 0.04
    await batcher.close()


async def test_different_buckets_run_in_separate_batches():
    model = FakeModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_s=0.05)
    await asyncio.gather(
        batcher.submit(1, bucket="a", timeout_s=5),
        batcher.submit(2, bucket="b", timeout_s=5),
        batcher.submit(3, bucket="a", timeout_s=5),
    )
    assert sorted(model.batches) == [[1, 3], [2]]
    await batcher.close()


async def test_a_full_queue_refuses_new_requests_and_keeps_the_accepted_ones():
    model = FakeModel(delay_s=0.3)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0, max_queue=2)
    first = asyncio.create_task(batcher.submit(0, bucket="a", timeout_s=5))
    await asyncio.sleep(0.05)  # running now; the queue is empty again
    queued = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=5)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull) as refused:
        await batcher.submit(3, bucket="a", timeout_s=5)
    assert refused.value.retry_after_s >= 1
    assert [r.value for r in await asyncio.gather(first, *queued)] == [0, 2, 4]
    await batcher.close()


async def test_a_request_past_its_deadline_is_dropped_and_never_runs():
    model = FakeModel(delay_s=0.4)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    busy = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=5))
    await asyncio.sleep(0.05)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(2, bucket="a", timeout_s=0.1)
    assert (await busy).value == 2
    await asyncio.sleep(0.05)
    assert model.batches == [[1]]
    assert batcher.depth == 0
    await batcher.close()


async def test_a_running_request_past_its_deadline_is_answered_at_the_deadline():
    model = FakeModel(delay_s=1.0)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, bucket="a", timeout_s=0.2)
    assert time.monotonic() - started < 0.6
    await asyncio.sleep(0.1)
    assert model.stopped_early  # its only member is gone, so the batch stopped
    await batcher.close()


async def test_a_cancelled_queued_request_is_removed_before_compute():
    model = FakeModel(delay_s=0.3)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    busy = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=5))
    await asyncio.sleep(0.05)
    doomed = asyncio.create_task(batcher.submit(2, bucket="a", timeout_s=5))
    await asyncio.sleep(0.02)
    assert batcher.depth == 1
    doomed.cancel()
    await asyncio.sleep(0.02)
    assert batcher.depth == 0
    await busy
    await asyncio.sleep(0.05)
    assert model.batches == [[1]]
    await batcher.close()


async def test_a_running_batch_stops_early_when_all_its_members_cancel():
    model = FakeModel(delay_s=5.0)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    task = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=10))
    await asyncio.to_thread(model.started.wait, 2)
    task.cancel()
    started = time.monotonic()
    while not model.stopped_early and time.monotonic() - started < 2:
        await asyncio.sleep(0.01)
    # The 5 s computation noticed within a polling interval that nobody waits for it.
    assert model.stopped_early
    assert time.monotonic() - started < 1.0
    await batcher.close()


async def test_a_failing_batch_fails_only_its_own_requests():
    model = FakeModel(fail_on=13)
    batcher = make_batcher(model, max_batch_size=2, max_wait_s=0.1)
    bad = await asyncio.gather(
        batcher.submit(13, bucket="a", timeout_s=5),
        batcher.submit(1, bucket="a", timeout_s=5),
        return_exceptions=True,
    )
    assert all(isinstance(r, BatchFailed) for r in bad)
    assert "RuntimeError: boom" in str(bad[0])
    good = await batcher.submit(5, bucket="a", timeout_s=5)
    assert good.value == 10
    await batcher.close()


async def test_an_out_of_memory_batch_is_split_in_halves_and_retried():
    model = FakeModel(max_fit=2)
    batcher = make_batcher(model, max_batch_size=4, max_wait_s=0.2)
    results = await asyncio.gather(*(batcher.submit(i, bucket="a", timeout_s=5) for i in range(4)))
    assert [r.value for r in results] == [0, 2, 4, 6]
    assert [r.batch_size for r in results] == [2, 2, 2, 2]
    assert model.batches == [[0, 1], [2, 3]]
    await batcher.close()


async def test_a_request_too_big_even_alone_fails_clearly():
    model = FakeModel(max_fit=0)
    batcher = make_batcher(model, max_batch_size=2, max_wait_s=0)
    with pytest.raises(BatchFailed, match="does not fit"):
        await batcher.submit(1, bucket="a", timeout_s=5)
    await batcher.close()


async def test_draining_finishes_queued_work_and_refuses_new_requests():
    model = FakeModel(delay_s=0.05)
    batcher = make_batcher(model, max_batch_size=2, max_wait_s=10)
    tasks = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=5)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert await batcher.drain(timeout_s=5)
    assert sorted(t.result().value for t in tasks) == [0, 2, 4]
    with pytest.raises(Draining):
        await batcher.submit(9, bucket="a", timeout_s=5)
    await batcher.close()


async def test_several_workers_run_batches_in_parallel():
    models = [FakeModel(delay_s=0.3), FakeModel(delay_s=0.3)]
    batcher = Batcher(
        "fake",
        [Worker("gpu0", models[0]), Worker("gpu1", models[1])],
        BatchPolicy(max_batch_size=1, max_wait_s=0, max_queue=8),
    )
    batcher.start()
    started = time.monotonic()
    results = await asyncio.gather(*(batcher.submit(i, bucket="a", timeout_s=5) for i in range(2)))
    assert time.monotonic() - started < 0.55
    assert {r.worker for r in results} == {"gpu0", "gpu1"}
    await batcher.close()


async def test_while_one_gpu_runs_a_long_batch_the_free_one_takes_the_queue():
    """Workers pull: a device busy with expensive work accumulates nothing, whatever the
    request count, so no per-device cost prediction is needed to balance them."""

    class SlowOnWide(FakeModel):
        def __call__(self, payloads, should_stop):
            self.delay_s = 0.6 if "wide" in payloads else 0.02
            return super().__call__(payloads, should_stop)

    models = [SlowOnWide(), SlowOnWide()]
    batcher = Batcher(
        "fake",
        [Worker("gpu0", models[0]), Worker("gpu1", models[1])],
        BatchPolicy(max_batch_size=1, max_wait_s=0, max_queue=16),
    )
    batcher.start()
    wide = asyncio.ensure_future(batcher.submit("wide", bucket="w", timeout_s=5))
    await asyncio.sleep(0.05)  # the wide batch is running on one of them
    narrow = await asyncio.gather(*(batcher.submit("n", bucket="n", timeout_s=5) for _ in range(8)))
    busy = (await wide).worker
    assert {r.worker for r in narrow} == {"gpu0", "gpu1"} - {busy}
    await batcher.close()


async def test_the_scheduler_sleeps_while_every_worker_is_busy():
    """Ready buckets with no idle worker must not spin the event loop (it starves compute)."""
    model = FakeModel(delay_s=0.6)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    tasks = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=10)) for i in range(4)]
    await asyncio.sleep(0.4)  # one batch running, three ready requests waiting
    steps = batcher.scheduling_steps
    await asyncio.sleep(0.15)
    assert batcher.scheduling_steps - steps <= 2
    for task in tasks:
        task.cancel()
    await batcher.close()
