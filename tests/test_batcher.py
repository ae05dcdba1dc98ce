"""The asyncio batcher with fake models: batching, deadlines, cancellation, failures, draining.

Every test runs on looptime's event loop, whose clock is virtual: when nothing is ready
to run, it jumps to the next timer, and the batcher reads that same clock
(`clock=loop.time`), so waits of seconds take no wall time and come out exact to the
microsecond.

A fake batch takes no time. One that must keep its worker busy waits at the model's
`gate` until the test opens it, so what runs before what never depends on how fast a
thread is. While a worker thread is busy looptime lets the loop's time pass at the real
pace; tests then wait for events (`until`), and no timing assertion measures a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import pytest

from batching import (
    CUT_OFF,
    Batcher,
    BatchFailed,
    BatchPolicy,
    DeadlineExceeded,
    Draining,
    OutOfMemory,
    QueueFull,
    Worker,
)

# A broken scheduler that spins stops looptime's clock (it moves only while the loop
# waits), so a test waiting for time to pass would hang; a timeout raised inside the
# loop's callbacks would be swallowed there, so the thread method ends the whole run.
pytestmark = [pytest.mark.looptime, pytest.mark.timeout(20, method="thread")]


class FakeModel:
    """Doubles its inputs at once and records every batch it ran.

    `gated` batches (all with True, or those a predicate picks) wait at `gate` until the
    test opens it, stopping early if `should_stop()` says every member is gone. A batch
    holding `fail_on` raises; one larger than `max_fit` runs out of memory.
    """

    instances: list[FakeModel] = []

    def __init__(
        self,
        gated: bool | Callable[[list], bool] = False,
        fail_on=None,
        max_fit: int | None = None,
    ):
        self.gated = gated
        self.fail_on = fail_on
        self.max_fit = max_fit
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.started = threading.Event()  # a batch began (on its worker thread)
        self.stopped_early = threading.Event()
        FakeModel.instances.append(self)

    def __call__(self, payloads, should_stop):
        if self.max_fit is not None and len(payloads) > self.max_fit:
            raise OutOfMemory(f"{len(payloads)} > {self.max_fit}")
        if self.fail_on is not None and self.fail_on in payloads:
            raise RuntimeError("boom")
        self.batches.append(list(payloads))
        self.started.set()
        held = self.gated(payloads) if callable(self.gated) else self.gated
        while held and not self.gate.wait(0.001):
            if should_stop():
                self.stopped_early.set()
                return [ValueError("stopped")] * len(payloads)
        return [p * 2 for p in payloads]


@pytest.fixture(autouse=True)
def _open_every_gate():
    """A batch still held when a test fails would keep its thread, and pytest, waiting."""
    yield
    for model in FakeModel.instances:
        model.gate.set()
    FakeModel.instances.clear()


def make_batcher(model, **policy) -> Batcher:
    defaults = dict(max_batch_size=4, max_wait_s=0.05, max_queue=64)
    batcher = Batcher(
        "fake",
        [Worker("cpu", model)],
        BatchPolicy(**{**defaults, **policy}),
        clock=asyncio.get_running_loop().time,
    )
    batcher.start()
    return batcher


async def until(event: threading.Event) -> None:
    """Wait for something a worker thread does (not for time to pass)."""
    assert await asyncio.to_thread(event.wait, 5), "the worker thread never got there"


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_concurrent_requests_of_one_bucket_share_a_batch():
    model = FakeModel()
    batcher = make_batcher(model, max_batch_size=4, max_wait_s=0.2)
    results = await asyncio.gather(*(batcher.submit(i, bucket="a", timeout_s=5) for i in range(4)))
    assert [r.value for r in results] == [0, 2, 4, 6]
    assert [r.batch_size for r in results] == [4, 4, 4, 4]
    assert model.batches == [[0, 1, 2, 3]]
    await batcher.close()


async def test_a_bucket_that_fills_runs_at_once_without_waiting_max_wait():
    batcher = make_batcher(FakeModel(), max_batch_size=4, max_wait_s=10)
    sent = now()
    await asyncio.gather(*(batcher.submit(i, bucket="a", timeout_s=60) for i in range(4)))
    assert now() - sent < 10
    await batcher.close()


@pytest.mark.parametrize("max_wait_ms", [3, 50, 100])
async def test_a_lone_request_waits_max_wait_for_company_then_runs_alone(max_wait_ms):
    """Arriving at an uneven time, as the settings give the wait (ms / 1000): the loop
    may run the scheduler's timer a hair before the launch time in floating point, and
    the bucket must launch then all the same."""
    max_wait_s = max_wait_ms / 1000
    batcher = make_batcher(FakeModel(), max_batch_size=8, max_wait_s=max_wait_s)
    await asyncio.sleep(0.0123)
    sent = now()
    result = await batcher.submit(21, bucket="a", timeout_s=5)
    assert result.value == 42 and result.batch_size == 1
    assert result.queue_wait_s == pytest.approx(max_wait_s, abs=1e-5)
    assert now() - sent == pytest.approx(max_wait_s, abs=1e-5)
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


async def test_requests_that_waited_behind_a_busy_worker_run_as_soon_as_it_frees():
    """`max_wait_s` counts from each request's arrival: a worker that frees after it
    has passed runs them at once, together, without waiting for company again."""
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=4, max_wait_s=0.02)
    first = asyncio.create_task(batcher.submit(0, bucket="a", timeout_s=5))
    await until(model.started)
    queued = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=5)) for i in (1, 2)]
    await asyncio.sleep(0.03)  # past their max_wait, behind the busy worker
    freed = now()
    model.gate.set()
    await asyncio.gather(first, *queued)
    assert model.batches == [[0], [1, 2]]
    assert now() - freed < 0.02
    await batcher.close()


async def test_a_full_queue_refuses_new_requests_and_keeps_the_accepted_ones():
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0, max_queue=2)
    first = asyncio.create_task(batcher.submit(0, bucket="a", timeout_s=5))
    await until(model.started)  # running now; the queue is empty again
    queued = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=5)) for i in (1, 2)]
    await asyncio.sleep(0)
    assert batcher.depth == 2
    with pytest.raises(QueueFull) as refused:
        await batcher.submit(3, bucket="a", timeout_s=5)
    assert refused.value.retry_after_s >= 1
    model.gate.set()
    assert [r.value for r in await asyncio.gather(first, *queued)] == [0, 2, 4]
    await batcher.close()


async def test_a_request_past_its_deadline_is_dropped_and_never_runs():
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    busy = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=5))
    await until(model.started)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(2, bucket="a", timeout_s=0.02)
    model.gate.set()
    assert (await busy).value == 2
    await asyncio.sleep(1)  # the worker is free: anything still queued would run now
    assert model.batches == [[1]]
    assert batcher.depth == 0
    await batcher.close()


async def test_a_running_request_past_its_deadline_is_answered_at_its_deadline():
    """Its batch is held and never finishes: the answer cannot wait for it."""
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    sent = now()
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, bucket="a", timeout_s=0.05)
    assert now() - sent == pytest.approx(0.05, abs=1e-5)
    assert model.batches == [[1]], "it was running, not queued"
    await batcher.close()


async def test_a_running_batch_stops_early_once_its_members_deadlines_pass():
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    with pytest.raises(DeadlineExceeded):
        await batcher.submit(1, bucket="a", timeout_s=0.05)
    await until(model.stopped_early)  # nobody waits for it: should_stop() said so
    await batcher.close()


async def test_a_running_batch_stops_early_when_all_its_members_cancel():
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    task = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=10))
    await until(model.started)
    task.cancel()
    await until(model.stopped_early)
    await batcher.close()


async def test_a_cancelled_queued_request_is_removed_before_compute():
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    busy = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=5))
    await until(model.started)
    doomed = asyncio.create_task(batcher.submit(2, bucket="a", timeout_s=5))
    await asyncio.sleep(0)
    assert batcher.depth == 1
    doomed.cancel()
    await asyncio.wait([doomed])
    assert batcher.depth == 0
    model.gate.set()
    await busy
    await asyncio.sleep(1)  # the worker is free: anything still queued would run now
    assert model.batches == [[1]]
    await batcher.close()


class _Refusals:
    """An observer that keeps the reasons the batcher counts refusals under."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    @contextlib.contextmanager
    def batch(self, batcher, worker, bucket, items):
        yield None

    def join(self, batcher, worker, bucket, items, running):
        return None, None

    def leave(self, handle):
        pass

    def queue_depth(self, batcher, depth):
        pass

    def rejected(self, batcher, reason):
        self.reasons.append(reason)


async def test_a_cancellation_counts_as_draining_when_the_servers_drain_cut_it_off():
    """A caller that goes away is `cancelled`; a request the drain's time-out cut off is
    `draining`, as its answer (503 `draining`) says."""
    model, refusals = FakeModel(gated=True), _Refusals()
    batcher = Batcher(
        "fake",
        [Worker("cpu", model)],
        BatchPolicy(max_batch_size=1, max_wait_s=0, max_queue=64),
        observer=refusals,
        clock=asyncio.get_running_loop().time,
    )
    batcher.start()
    running = asyncio.create_task(batcher.submit(1, bucket="a", timeout_s=5))
    await until(model.started)
    queued = asyncio.create_task(batcher.submit(2, bucket="a", timeout_s=5))
    await asyncio.sleep(0)
    queued.cancel()  # its caller went away
    running.cancel(CUT_OFF)
    await asyncio.wait([queued, running])
    model.gate.set()
    assert refusals.reasons == ["cancelled", "draining"]
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


async def test_draining_runs_queued_requests_at_once_and_waits_for_running_batches():
    """The third request would wait 10 s for company, past drain's 5 s limit."""
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=2, max_wait_s=10)
    tasks = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=60)) for i in range(3)]
    await until(model.started)  # the first two, a full batch; the third queued
    drained = asyncio.create_task(batcher.drain(timeout_s=5))
    await asyncio.sleep(0)  # draining, with a batch running
    model.gate.set()
    assert await drained
    assert [t.result().value for t in tasks] == [0, 2, 4]  # every one answered by then
    await batcher.close()


async def test_a_draining_batcher_refuses_new_requests():
    batcher = make_batcher(FakeModel())
    assert await batcher.drain(timeout_s=5)
    with pytest.raises(Draining):
        await batcher.submit(9, bucket="a", timeout_s=5)
    await batcher.close()


async def test_several_workers_run_batches_in_parallel():
    models = [FakeModel(gated=True), FakeModel(gated=True)]
    batcher = Batcher(
        "fake",
        [Worker("gpu0", models[0]), Worker("gpu1", models[1])],
        BatchPolicy(max_batch_size=1, max_wait_s=0, max_queue=8),
        clock=asyncio.get_running_loop().time,
    )
    batcher.start()
    tasks = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=5)) for i in range(2)]
    for model in models:
        await until(model.started)  # both batches run while neither can finish
    for model in models:
        model.gate.set()
    assert {(await task).worker for task in tasks} == {"gpu0", "gpu1"}
    await batcher.close()


async def test_while_one_gpu_runs_a_long_batch_the_free_one_takes_the_queue():
    """Workers pull: a device busy with expensive work accumulates nothing, whatever the
    request count, so no per-device cost prediction is needed to balance them."""
    model = FakeModel(gated=lambda payloads: "wide" in payloads)  # both devices run it
    batcher = Batcher(
        "fake",
        [Worker("gpu0", model), Worker("gpu1", model)],
        BatchPolicy(max_batch_size=1, max_wait_s=0, max_queue=16),
        clock=asyncio.get_running_loop().time,
    )
    batcher.start()
    wide = asyncio.create_task(batcher.submit("wide", bucket="w", timeout_s=5))
    await until(model.started)  # the wide batch holds one of them until the gate opens
    narrow = await asyncio.gather(*(batcher.submit("n", bucket="n", timeout_s=5) for _ in range(8)))
    model.gate.set()
    busy = (await wide).worker
    assert {r.worker for r in narrow} == {"gpu0", "gpu1"} - {busy}
    await batcher.close()


async def test_the_scheduler_sleeps_while_every_worker_is_busy():
    """Ready buckets with no idle worker must not spin the event loop (it starves compute)."""
    model = FakeModel(gated=True)
    batcher = make_batcher(model, max_batch_size=1, max_wait_s=0)
    tasks = [asyncio.create_task(batcher.submit(i, bucket="a", timeout_s=10)) for i in range(4)]
    await until(model.started)  # one batch running, three ready requests waiting
    await asyncio.sleep(0)
    steps = batcher.scheduling_steps
    for _ in range(100):  # a hundred turns of the event loop; no time passes
        await asyncio.sleep(0)
    assert batcher.depth == 3
    assert batcher.scheduling_steps - steps <= 2
    model.gate.set()
    await asyncio.gather(*tasks)
    await batcher.close()
